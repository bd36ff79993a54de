"""The `smoe` command: one entry point per user action, each a thin call into the packages below."""

from smoe.cli.interrupts import guarded


def main(argv: list[str] | None = None) -> int:
    """The command line; the commands' modules load inside the interrupt guard (with the parser, torch: a second or two)."""
    def parser():
        from smoe.cli.commands import build_parser

        return build_parser()

    def body(parser) -> int:
        from smoe.cli.commands import run

        return run(parser, argv)

    return guarded(parser, body)


__all__ = ["main"]
