"""The errors a user reads: raised anywhere in core or a plugin, their message is meant for the user.

Kept apart from every other module so that any of them can raise one without importing the
plugin manager (or anything else) of the core.
"""

import signal

EXIT_ERROR = 1
"""The exit code of an error the user can fix: bad config, data or plugin; a training failure it explains."""
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The exit code of a run stopped by each signal it stops on (128 + the signal's number, as a shell says)."""


class PluginError(Exception):
    """A plugin cannot be found, loaded or configured, or an input is wrong; the message is meant for the user."""


class DataError(PluginError):
    """Bad dataset input; the message names the file and line."""
