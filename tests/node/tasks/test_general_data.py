"""The public general pairs the chat task rehearses: away from the probe, mixed into the pool."""

from __future__ import annotations

import re

import pytest

from experiments.general_probe import PROBE
from node.tasks import instruct_data as qa
from node.tasks.general_data import GENERAL_PAIRS, general_mix
from node.tasks.tasks import ChatTask


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.casefold()))


def test_no_general_pair_names_a_probe_question_or_its_answers():
    """Rehearsal must not teach the probe: no probe question, expected or contrary answer word."""
    words = set().union(*(_words(p.question) | _words(p.answer) for p in GENERAL_PAIRS))
    for question, good, bad in PROBE:
        assert question not in {p.question for p in GENERAL_PAIRS}
        assert not (_words(good) | _words(bad)) - {"the", "ocean", "william"} & words, (question, good, bad)


def test_general_pairs_are_asked_without_the_python_system_prompt():
    codec = qa.ByteChatCodec()
    pair = GENERAL_PAIRS[0]
    text = codec.decode(qa.prompt_ids(codec, pair.question, pair.system))
    assert qa.SYSTEM_PROMPT not in text and pair.question in text
    assert qa.SYSTEM_PROMPT in codec.decode(qa.prompt_ids(codec, pair.question))


def test_general_mix_cycles_and_refuses_a_negative_count():
    assert general_mix(len(GENERAL_PAIRS) + 2)[-2:] == GENERAL_PAIRS[:2]
    assert general_mix(0) == ()
    with pytest.raises(ValueError, match=">= 0"):
        general_mix(-1)


def test_the_chat_pool_is_the_share_then_its_general_share():
    plain = ChatTask(0, 2, 0, chat_model="tiny", general_mix=0.0)
    mixed = ChatTask(0, 2, 0, chat_model="tiny", general_mix=0.25)
    assert plain.pool == plain.share and plain.num_examples == len(plain.share)
    n = len(mixed.share)
    assert mixed.pool[:n] == mixed.share
    extra = mixed.pool[n:]
    assert len(extra) == -(-n // 3) and set(extra) <= set(GENERAL_PAIRS)
    assert mixed.num_examples == len(mixed.pool)  # DP-SGD's Poisson rate is over the whole pool


@pytest.mark.parametrize("mix", [-0.1, 1.0, float("nan")])
def test_a_general_mix_outside_0_1_is_refused(mix):
    with pytest.raises(ValueError, match="general_mix"):
        ChatTask(0, 2, 0, chat_model="tiny", general_mix=mix)


def test_training_batches_draw_general_pairs(monkeypatch):
    """The non-private path samples the pool, not the share alone."""
    task = ChatTask(0, 2, 0, chat_model="tiny", general_mix=0.5, steps_per_epoch=6, batch_size=8)
    seen: list[qa.QAPair] = []
    real = qa.batch
    monkeypatch.setattr(qa, "batch", lambda codec, pairs, *a: (seen.extend(pairs), real(codec, pairs, *a))[1])
    task.train(task.build_model(0), 1, 1e-3, seed=0)
    assert any(p in GENERAL_PAIRS for p in seen) and any(p in task.share for p in seen)
