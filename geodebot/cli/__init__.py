"""The ``geodebot`` command line: one command group per module."""
