"""The `smoe` command: one entry point per user action, each a thin call into the packages below."""

from smoe.cli.interrupts import guarded


def main(argv: list[str] | None = None) -> int:
    """The command line; the commands' modules load inside the interrupt guard (they take a tenth of a second)."""
    def body() -> int:
        from smoe.cli.commands import run

        return run(argv)

    return guarded(body)


__all__ = ["main"]
