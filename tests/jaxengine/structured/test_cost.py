"""The cost script runs and reports what it measured."""

from jaxengine.structured import StructuredOutputsParams
from jaxengine.structured.cost import batch_fill_us, main, measure


def test_measure_generates_until_the_grammar_ends(compiler) -> None:
    cost = measure(compiler, StructuredOutputsParams(choice=["alpha-cost", "beta-cost"]),
                   steps=50)
    assert 2 <= cost.num_tokens < 50  # at least one text token and the EOS
    assert cost.compile_us > 0 and cost.fill_us > 0 and cost.accept_us > 0
    assert batch_fill_us(compiler, StructuredOutputsParams(regex="[0-9]+"), rows=3,
                         repeat=2, parallel=True) > 0


def test_main_prints_one_line_per_kind(capsys) -> None:
    main(["--steps", "5", "--rows", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tokenizer for llguidance") and "V = 49152" in lines[0]
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "json schema", "json schema, 400 fields", "json_object", "regex", "choice"]
