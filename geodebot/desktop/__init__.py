"""The desktop agent: its own process beside the display, for computer use."""
