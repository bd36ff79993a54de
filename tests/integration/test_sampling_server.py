"""The server's sampling defaults are the command line's: `smoe generate --json` without sampling options,
then the same prompt over a socket with only the seed it reported (a server start: too slow for `make test`,
which checks each route's defaults without a socket in tests/test_sampling_defaults.py)."""

import json

import openai

from smoe.runtime.sampling import SamplingParams

QWEN3_DEFAULTS = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)  # min_p: llama.cpp's
PROMPT = "The sea was"


def test_a_request_without_sampling_fields_replays_generate_given_only_its_seed(sampling_vaults, start_server,
                                                                                capsys):
    """`smoe generate --json` without sampling options; then the same prompt over a socket with only the
    seed it reported: the server's defaults are the command line's, and the seed replays the text."""
    from smoe.cli.commands import main

    vault = sampling_vaults["qwen3"]
    assert main(["generate", str(vault), "-p", PROMPT, "--max-tokens", "16", "--json", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out)
    seed = out["sampling"]["seed"]
    assert isinstance(seed, int) and out["sampling"] == QWEN3_DEFAULTS.as_dict() | {"seed": seed}
    server = start_server(vault)
    assert server.health["sampling"] == QWEN3_DEFAULTS.as_dict()  # what the web page shows and leaves to the server
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=16, seed=seed)
    assert r.choices[0].text == out["text"]
