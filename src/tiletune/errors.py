"""The one exception type for mistakes a user can fix: the CLI prints it as one line and exits 2."""


class UserError(Exception):
    """A problem in the user's input (config, data, paths): what is wrong, where, and how to fix it."""
