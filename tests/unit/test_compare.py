"""`flywheel eval --models`: two models on the same tasks through the real proxy and a scripted
OpenAI-compatible server, the report's figures (reward, pass@k, tokens, cost, a paired test),
and the checks on its flags."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flywheel.ops.compare import ModelSpec, compare, paired, parse_models, read_prices
from flywheel.runtime.evaluation import EvalConfig
from flywheel.runtime.serving import Served
from tests.unit.test_eval import Upstream, serving


class TwoModels(Upstream):
    """'good' answers the user's text reversed (reverse_text's reward 1.0); 'weak' says 'nope'."""

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        text = body["messages"][-1]["content"]
        return {"role": "assistant", "content": text[::-1] if body["model"] == "good" else "nope"}


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[TwoModels, Served]]:
    async for pair in serving(TwoModels()):
        yield pair


async def test_two_models_on_the_same_tasks_make_one_report(upstream: tuple[TwoModels, Served],
                                                          tmp_path: Path) -> None:
    url = upstream[1].url + "/v1"
    base = EvalConfig(env="reverse_text", model="", base_url=url, out=tmp_path / "unused.jsonl", num_tasks=6,
                      num_rollouts=2, concurrency=4, seed=3)
    models = parse_models(f"good,weak@{url}", "http://elsewhere/v1")
    assert models == [ModelSpec("good", "http://elsewhere/v1"), ModelSpec("weak", url)]
    models[0] = ModelSpec("good", url)
    prices = {"good": {"prompt_per_mtok": 2.0, "completion_per_mtok": 10.0}}
    report = await compare(base, models, prices, tmp_path / "evals")
    good, weak = report["models"]
    assert good["summary"]["reward_mean"] > weak["summary"]["reward_mean"]
    assert good["summary"]["pass@1"] == 1.0 and weak["summary"]["pass@1"] == 0.0
    assert good["first_error"] is None and weak["first_error"] is None
    assert good["cost"] == pytest.approx((good["summary"]["prompt_tokens"] * 2 + good["summary"]["completion_tokens"]
                                          * 10) / 1e6) and weak["cost"] is None
    # The same tasks for both: the paired comparison spans all six.
    tasks = {m: {json.dumps(json.loads(line)["task"]) for line in Path(row["results"]).read_text().splitlines()}
             for m, row in (("good", good), ("weak", weak))}
    assert tasks["good"] == tasks["weak"] and len(tasks["good"]) == 6
    (pair,) = report["pairs"]
    assert (pair["a"], pair["b"], pair["num_tasks"]) == ("good", "weak", 6)
    assert pair["mean_diff"] > 0 and pair["p_value"] == pytest.approx(2 / 64)  # every sign agrees: the two extremes
    text = Path(report["markdown"]).read_text()
    assert "| good | 1.000 ± 0.000 |" in text and "| good | weak | 6 |" in text
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(Path(report["json"]).read_text())["pairs"] == report["pairs"]


def test_the_paired_test_is_exact_for_few_tasks_and_drawn_for_many() -> None:
    assert paired({"a": 1.0}, {"b": 1.0})["num_tasks"] == 0
    same = paired({f"t{i}": 0.5 for i in range(5)}, {f"t{i}": 0.5 for i in range(5)})
    assert same["mean_diff"] == 0.0 and same["p_value"] == 1.0
    mixed = paired({"t0": 1.0, "t1": 0.0, "t2": 1.0}, {"t0": 0.0, "t1": 1.0, "t2": 0.0})
    assert mixed["mean_diff"] == pytest.approx(1 / 3) and mixed["p_value"] == 1.0  # every flip is as far out
    many = paired({f"t{i}": 0.6 for i in range(40)}, {f"t{i}": 0.5 for i in range(40)})
    assert many["p_value"] < 0.001 and many["stderr"] == pytest.approx(0.0)


@pytest.mark.parametrize(("text", "said"), [
    ("a", "at least two models"), ("a,,b", "entry 2 is empty"), ("a,b@localhost:8000", "after @ comes"),
    ("a,a", "named twice")])
def test_bad_models_are_named(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_models(text, "http://x/v1")


@pytest.mark.parametrize(("toml", "said"), [
    ('["a"]\nprompt_per_mtok = -1\n', "a price of at least 0"),
    ('["a"]\ninput = 1\n', "known keys are prompt_per_mtok, completion_per_mtok"),
    ('["c"]\nprompt_per_mtok = 1\n', "which --models does not name"),
    ('a = 1\n', "must be a table"), ("[", "--prices")])
def test_bad_price_tables_are_named(toml: str, said: str, tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=said):
        read_prices(path, parse_models("a,b", "http://x/v1"))


@pytest.mark.parametrize(("args", "said"), [
    (["--models", "a"], "name at least two models"),
    (["--models", "a,b", "--out", "x.jsonl"], "--out is for one model"),
    (["--models", "a,b", "--push"], "--push is for one model"),
    (["--model", "a", "--prices", "p.toml"], "--prices is for --models"),
])
def test_eval_models_mistakes_name_the_option(args: list[str], said: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.ops.cli import main

    assert main(["eval", "reverse_text", "--data-dir", str(tmp_path), *args]) == 1
    assert said in capsys.readouterr().err


def test_the_report_says_why_a_models_rollouts_failed() -> None:
    from flywheel.ops.compare import markdown

    summary = {"reward_mean": None, "reward_stderr": None, "pass@1": 0.0, "prompt_tokens": 0,
               "completion_tokens": 0, "num_errors": 2}
    text = markdown({"env": "e", "num_tasks": 2, "num_rollouts": 1, "seed": 0, "pairs": [], "models": [
        {"model": "down", "summary": summary, "cost": None, "results": "r.jsonl",
         "first_error": "harness failed: ModelCallError: unreachable"}]})
    assert "- down: 2 rollouts failed; the first: harness failed: ModelCallError: unreachable (all in r.jsonl)" in text
