"""Helpers for the tests: fakes of the platforms and the model, worlds that wire them to a
daemon, and small tools. Nothing here is a test."""
