import pytest

from jaxrl.data import load_tokenizer, synthetic
from jaxrl.testing.scripted import calculator_chain, scripted_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(tokenizer, config, params) of a policy that answers every chat with a hermes call of
    the calculator, with a weight that leaves other tokens some mass: sampled answers differ
    by key."""
    folder = tmp_path_factory.mktemp("serve_tokenizer")
    synthetic.write_tokenizer(folder, tools=True)
    tokenizer = load_tokenizer(str(folder))
    config, params = scripted_policy(tokenizer, calculator_chain("7"), weight=6.0)
    return tokenizer, config, params
