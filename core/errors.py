"""The errors a user reads: raised anywhere in core or a plugin, their message is meant for the user.

Kept apart from every other module so that any of them can raise one without importing the
plugin manager (or anything else) of the core.
"""


class PluginError(Exception):
    """A plugin cannot be found, loaded or configured, or an input is wrong; the message is meant for the user."""


class DataError(PluginError):
    """Bad dataset input; the message names the file and line."""
