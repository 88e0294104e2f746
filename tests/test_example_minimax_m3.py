"""``examples/run_minimax_m3.py`` end to end in a real process, on a tiny MiniMax-M3-shaped pair.

The pair is the oracle construction of ``tests/proposers`` (a nearly-bigram M3 target with
128-token block-sparse layers and an EAGLE3 draft, ``layers.0.*`` keys, that computes the same
bigram), so the printed acceptance is high and checkable (on one rank and on two); a word-level
tokenizer is added to the target so the script's text prompts work. The zoo-missing message runs with the zoo folder
pointed at an empty directory.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "run_minimax_m3.py"
sys.path.insert(0, str(Path(__file__).resolve().parent / "proposers"))

from eagle3_oracle import save_minimax_m3_target, write_oracle_draft  # noqa: E402
from eagle3_reference import DraftSpec  # noqa: E402

WORDS = ["def", "class", "import", "return", "for", "in", "if", "with", "as", "self", "(", ")", ":", "=", "n"]


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """Words and punctuation over ``vocab_size`` ids: <unk>=0, <s>=1, </s>=2 (the target's bos/eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS + [f"w{i}" for i in range(vocab_size)]:
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("m3_example")
    target = save_minimax_m3_target(root / "target")
    save_tokenizer(target, 64)
    write_oracle_draft(
        root / "draft", DraftSpec(layout="vllm", kv_heads=4, aux_ids=(0, 1, 2), draft_vocab=48), target
    )
    return target, root / "draft"


def run_script(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport runpy, sys\nsys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]\n"
    code += f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_runs_a_tiny_m3_pair_end_to_end(pair, ranks):
    target, draft = pair
    proc = run_script("--model", str(target), "--draft", str(draft), "--max-tokens", "12",
                      "--tensor-parallel-size", str(ranks))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "eagle3, k=3, block size 128" in out
    assert ("tensor parallel 2" in out) == (ranks == 2)
    assert out.count("--- prompt ") == 5 and out.count("(12 tokens)") == 5
    # Greedy float64 speculation is lossless.
    assert "outputs identical without speculation: 5/5" in out
    rates = [float(x) for x in re.search(r"acceptance per position: ([\d., ]+)", out).group(1).split(", ")]
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)
    assert rates == sorted(rates, reverse=True)  # position i+1 is only reached through position i
    tau = float(re.search(r"mean acceptance length: ([\d.]+)", out).group(1))
    assert tau == pytest.approx(1 + sum(rates), abs=0.01)  # printed to 3 and 2 decimals
    assert tau > 1.3  # the oracle draft computes the target's bigram: it must be accepted often
    speeds = re.search(r"without speculation ([\d.]+), with eagle3 k=3 ([\d.]+)", out)
    assert speeds and float(speeds.group(1)) > 0 and float(speeds.group(2)) > 0


def test_missing_zoo_is_one_line_naming_build_zoo(tmp_path):
    prelude = f"import specdec.zoo as zoo, pathlib\nzoo.ZOO_DIR = pathlib.Path({str(tmp_path)!r})"
    proc = run_script(prelude=prelude)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "python scripts/build_zoo.py" in lines[0]
    assert proc.stdout == ""


def _load_example():
    spec = importlib.util.spec_from_file_location("run_minimax_m3_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
        # Found on the target's shapes before any process starts (the zoo target has 6 heads).
        (["--tensor-parallel-size", "4"], "(6) is not divisible by tensor_parallel_size 4"),
        (["--model", "/some/target"], "--model and --draft together"),
        (["--model", "/no/such/target", "--draft", "/no/such/draft"], "does not exist"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1"),
        (["--max-tokens", "many"], "--max-tokens"),
    ],
)
def test_errors_are_one_line_with_exit_2(args, needle, capsys):
    code = _load_example().main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
