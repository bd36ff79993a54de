"""The command line as llama-cli users type it: every option has help, the top-level help names every command,
-m/-n/-f/-c/-t/--temp/--io-threads and a prompt on stdin, and hints that never write over a model."""

import argparse
import io
import json
import sys

import pytest

from smoe.cli.commands import build_parser, main


def run(capsys, *args) -> tuple[int, str, str]:
    try:
        status = main([str(a) for a in args])
    except SystemExit as e:  # argparse's errors and --help
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def all_parsers(parser: argparse.ArgumentParser, name: str = "smoe"):
    yield name, parser
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for sub_name, sub in action.choices.items():
            yield from all_parsers(sub, f"{name} {sub_name}")


def test_every_option_and_argument_of_every_command_has_help():
    missing = [f"{name}: {'/'.join(a.option_strings) or a.metavar or a.dest}"
               for name, parser in all_parsers(build_parser()) for a in parser._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert missing == []


def test_the_top_level_help_describes_every_command(capsys):
    status, out, _ = run(capsys, "--help")
    description = out.split("positional arguments")[0]
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert status == 0 and [c for c in commands if c not in description] == []


def test_the_not_a_vault_hint_writes_beside_a_model_never_over_it(tiny_qwen_vault, capsys):
    model = tiny_qwen_vault["model"]
    status, _, err = run(capsys, "generate", model, "-p", "x")
    assert status == 2 and err.count("\n") == 1
    assert f"-o {model}-q4`" in err and f"-o {model}`" not in err


def test_a_prompt_from_a_file_or_stdin_generates_what_the_same_prompt_with_p_does(tiny_qwen_vault, tmp_path, capsys,
                                                                                  monkeypatch):
    vault = tiny_qwen_vault["vault"]
    (tmp_path / "prompt.txt").write_text("The cat")
    common = ["--temperature", "0", "--max-tokens", "4", "--json"]
    by_p = json.loads(run(capsys, "generate", vault, "-p", "The cat", *common)[1])["tokens"]
    by_file = json.loads(run(capsys, "generate", vault, "-f", tmp_path / "prompt.txt", *common)[1])["tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("The cat"))  # a pipe: not a terminal
    status, out, err = run(capsys, "generate", "-m", vault, "-n", "4", "-t", "1", "--temp", "0", "--io-threads", "2",
                           "--json")
    assert status == 0, err
    assert by_p == by_file == json.loads(out)["tokens"] and len(by_p) == 4


def test_without_a_prompt_on_a_terminal_generate_says_how_to_give_one(tiny_qwen_vault, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    status, _, err = run(capsys, "generate", tiny_qwen_vault["vault"])
    assert status == 2 and err == "smoe: error: no prompt: give -p TEXT or -f FILE, or pipe it on stdin\n"


def test_ctx_caps_the_output_and_a_prompt_that_fills_it_is_a_one_line_error(tiny_qwen_vault, capsys):
    vault = tiny_qwen_vault["vault"]
    common = ["generate", vault, "-p", "The cat sat", "--temp", "0", "-n", "8", "--json"]
    status, out, err = run(capsys, *common, "-c", "12")
    prompt = 12 - len(json.loads(out)["tokens"])
    assert status == 0 and 4 < prompt < 12, err  # the output stopped at the context, before its 8 tokens
    status, _, err = run(capsys, *common, "-c", str(prompt))
    assert status == 2 and err.startswith("smoe: error: the prompt is") and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["generate", "-p", "x"], "VAULT_DIR (or -m VAULT_DIR)"),
    (["generate", "A", "-m", "B", "-p", "x"], "give the vault once"),
    (["generate", "A", "-p", "x", "-f", "F"], "not allowed with argument"),
])
def test_the_vault_and_the_prompt_are_given_once(args, message, capsys):
    status, _, err = run(capsys, *args)
    assert status == 2 and message in err and err.strip().splitlines()[-1].startswith("smoe: error:")


def test_the_input_weighted_snr_is_the_snr_of_the_projections_output_on_those_inputs():
    import torch

    from smoe.format import codec

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 128, generator=g), torch.randn(4096, 128, generator=g) * torch.linspace(0.1, 3, 128)
    approx = w + 0.05 * torch.randn(32, 128, generator=g)
    measured = 10 * torch.log10((x @ w.T).square().sum() / (x @ (w - approx).T).square().sum())
    moment = x.T @ x / len(x)
    assert codec.weighted_snr_db(w, approx, moment) == pytest.approx(float(measured), abs=1e-3)
    # an error on the inputs that are nearly always small barely reaches the output: the weight SNR undersells it
    quiet = w.clone()
    quiet[:, :32] += 0.2 * torch.randn(32, 32, generator=g)
    assert codec.weighted_snr_db(w, quiet, torch.diagonal(moment)) > codec.snr_db(w, quiet) + 10
