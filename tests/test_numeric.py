"""Every numeric CLI option and request field is checked by one shared rule (smoe/numeric.py)."""

import argparse
import json
import typing

import pytest
import torch

from smoe import numeric
from smoe.cli.commands import build_parser, main
from smoe.runtime.sampling import SamplingParams, Sequence, sample_batch
from smoe.serve.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest

PLACEHOLDERS = {"-o": "out", "-p": "hi", "--ref": "ref", "--data": "data", "--to": "gguf", "--budget": "3"}


def numeric_options():
    """(subcommand words, option, its Range) for every numeric option of every subcommand."""
    found = []

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, words + [name])
            elif action.option_strings and action.type is not None:
                found.append((words, action))

    walk(build_parser(), [])
    return found


def argv_for(words, parser_words_action):
    """The subcommand with its required arguments filled in, then the option under test."""
    parser = build_parser()
    for w in words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[w]
    argv = list(words)
    for action in parser._actions:
        if not action.option_strings and action.dest not in ("help", "command", "bench"):
            argv.append("x")
        elif action.required and action is not parser_words_action:
            group = [o for o in action.option_strings if o in PLACEHOLDERS]
            if group:  # mutually exclusive groups are not required per option; plan's --budget is
                argv += [group[0], PLACEHOLDERS[group[0]]]
    return argv


def bad_values(rule: numeric.Range) -> list[str]:
    values = ["nan", "inf", "-inf", "abc", ""]
    if rule.low is not None:
        values.append(str(rule.low) if rule.low_open else str(rule.low - 1))
    if rule.high is not None:
        values.append(str(rule.high * 2 + 1))
    if rule.kind is int:
        values.append("1.5")
    return values


def test_every_numeric_option_has_a_shared_range():
    for words, action in numeric_options():
        if action.choices is None:
            assert isinstance(getattr(action.type, "__self__", None), numeric.Range), (words, action.option_strings)


@pytest.mark.parametrize("words, action", [pytest.param(w, a, id=" ".join(w + [a.option_strings[-1]]))
                                           for w, a in numeric_options() if a.choices is None])
def test_every_numeric_option_rejects_nan_and_out_of_range(words, action, capsys):
    rule = action.type.__self__
    for value in bad_values(rule):
        argv = argv_for(words, action) + [action.option_strings[-1], value]
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith("smoe: error: argument"), (argv, err)


def test_an_unknown_option_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "v", "-p", "x", "--no-such-flag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: smoe generate") and err.rstrip().endswith("unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-6, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [0.0, 1e-12, 0.5, 1.0])
def test_the_sampler_is_safe_for_every_value_in_range(temperature, top_p):
    seq = Sequence(SamplingParams(temperature=temperature, top_p=top_p, seed=0))
    logits = torch.randn(1, 64) * 30
    for _ in range(20):
        token = sample_batch(logits, [seq])[0]
        assert 0 <= token < 64
    if temperature < 1e-6 or top_p == 0.0:
        assert sample_batch(logits, [seq])[0] == int(logits.argmax())


# --- the server ----------------------------------------------------------------------------------

BASE = {
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    "/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
    "/v1/messages": (MessagesRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
}


def numeric_fields():
    """(path, field name, rule) for every int/float field of every request body."""
    for path, (model, _) in BASE.items():
        for name, info in model.model_fields.items():
            kinds = {t for t in typing.get_args(info.annotation) or (info.annotation,) if t in (int, float)}
            if kinds and name != "n":
                bounds = {type(m).__name__: m for m in info.metadata}
                yield path, name, kinds, bounds


def bad_request_values(kinds, bounds) -> list:
    """Wrong types, and the nearest values outside each bound."""
    step = 1 if float not in kinds else 1e-6
    values = ["1", True, [1], {"x": 1}]
    if "Ge" in bounds:
        values.append(bounds["Ge"].ge - step)
    if "Gt" in bounds:
        values.append(bounds["Gt"].gt)
    if "Le" in bounds:
        values.append(bounds["Le"].le + step)
    return values


def test_every_numeric_request_field_has_bounds():
    for path, name, kinds, bounds in numeric_fields():
        assert "Ge" in bounds or "Gt" in bounds, (path, name)
        if float in kinds:
            assert any(getattr(m, "allow_inf_nan", None) is False for m in bounds.values()), (path, name)


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault, "--max-tokens", "8")


def post(server, path, raw: bytes):
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.getheader("content-type", ""), r.read()
    conn.close()
    return out


@pytest.mark.parametrize("path, name, kinds, bounds", [pytest.param(*f, id=f"{f[0]} {f[1]}") for f in numeric_fields()])
def test_every_numeric_request_field_rejects_nan_and_out_of_range(server, path, name, kinds, bounds):
    _, base = BASE[path]
    raws = [json.dumps(base | {name: v}).encode() for v in bad_request_values(kinds, bounds)]
    raws += [json.dumps(base).encode()[:-1] + f', "{name}": {v}}}'.encode() for v in ("NaN", "Infinity", "-Infinity")]
    if int in kinds and float not in kinds:
        raws.append(json.dumps(base | {name: 1.5}).encode())
    for raw in raws:
        status, content_type, body = post(server, path, raw)
        assert 400 <= status < 500 and content_type == "application/json", (raw, status, body)
        error = json.loads(body)
        assert (error["type"] == "error") if path == "/v1/messages" else ("param" in error["error"]), (raw, body)


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 2.0])
@pytest.mark.parametrize("top_p", [0, 1e-12, 1])
def test_tiny_and_extreme_sampling_values_in_range_are_answered(server, temperature, top_p):
    raw = json.dumps({"prompt": "The sea", "max_tokens": 2, "temperature": temperature, "top_p": top_p}).encode()
    status, _, body = post(server, "/v1/completions", raw)
    assert status == 200, body
