"""``TextStream``: incremental text equal to decoding the whole output, stop strings that end it at
the same token however the tokens were grouped into steps, and streaming that never sends a piece of a
stop string or half a character."""

from __future__ import annotations

import random

import pytest

from specdec.text import TextStream
from specdec.tokenizer import load_tokenizer
from specdec.zoo import zoo_path


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(zoo_path("llama-tiny"))


def _feed(stream: TextStream, ids, rng) -> list[str]:
    sent, i = [], 0
    while i < len(ids):
        n = rng.randrange(1, 5)  # a speculative step emits 1..k+1 tokens
        stream.push(ids[i : i + n])
        i += n
        sent.append(stream.unsent(finished=False))
    stream.finish()
    sent.append(stream.unsent(finished=True))
    return sent


def test_text_is_the_whole_output_decoded_whatever_the_steps(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 50))]
        stream = TextStream(tok)
        sent = _feed(stream, ids, rng)
        assert stream.text == tok.decode(ids, skip_special_tokens=True) == "".join(sent)
        assert stream.num_tokens == len(ids) and not stream.stopped
        assert not any(piece.endswith("\ufffd") for piece in sent[:-1])  # half characters wait to complete
        # Without stop strings tokens are decoded when the text is read: at the end, or now and then.
        unread, sometimes = TextStream(tok), TextStream(tok)
        for start in range(0, len(ids), 3):
            unread.push(ids[start : start + 3])
            sometimes.push(ids[start : start + 3])
            if rng.random() < 0.3:  # read: all the text so far, less a character still incomplete
                so_far = tok.decode(ids[: start + 3], skip_special_tokens=True)
                assert sometimes.text == so_far if not so_far.endswith("\ufffd") else so_far.startswith(sometimes.text)
        unread.finish()
        sometimes.finish()
        assert unread.text == sometimes.text == stream.text and unread.num_tokens == len(ids)


def test_a_stop_string_ends_the_text_at_the_same_token_for_any_grouping(tok):
    ids = tok("def main():\n    return 1\n\nclass Stack:\n    pass\n")["input_ids"][1:]
    full = tok.decode(ids)
    for seed in range(20):
        rng = random.Random(seed)
        stream = TextStream(tok, stop=["\n\n", "Stack"])
        sent = _feed(stream, ids, rng)
        assert stream.stopped and stream.text == full[: full.index("\n\n")] == "".join(sent)
        # The kept tokens are those up to the one that completed the stop string.
        kept = ids[: stream.num_tokens]
        assert "\n\n" in tok.decode(kept) and "\n\n" not in tok.decode(kept[:-1])


def test_streaming_holds_back_only_what_could_begin_a_stop_string(tok):
    stream = TextStream(tok, stop=["STOP"])
    for word in ["hello", " ST", "O"]:
        stream.push(tok(word, add_special_tokens=False)["input_ids"])
    assert stream.text == "hello STO" and stream.unsent(finished=False) == "hello "
    stream.push(tok("x", add_special_tokens=False)["input_ids"])  # "STOx" can no longer be "STOP"
    assert stream.unsent(finished=False) == "STOx" and not stream.stopped
