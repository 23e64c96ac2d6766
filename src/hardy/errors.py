"""User-facing errors: the CLI prints these as one line and exits with code 2."""


class HardyError(Exception):
    """Bad input from the user (file, config, data): reported without a traceback."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise HardyError(message)


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message cut to its first line (at most `limit` characters), for a one-line report."""
    return (str(error).splitlines() or [""])[0][:limit]
