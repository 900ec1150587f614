"""The two federated tasks a node can serve, behind one small interface.

* ``digits``: scikit-learn's digits, a small MLP, Dirichlet non-IID split (flwr-datasets);
  metric = accuracy. Fast: what the privacy/accuracy sweeps use.
* ``lm``: the byte-level TinyTransformer on the standard library's sources, one share of
  whole top-level modules per node (non-IID); metric = perplexity on the held-out modules.
* ``chat``: FFA-LoRA adapters (``node.models.lora``) on a frozen Llama -- SmolLM2-135M-Instruct
  (``chat`` = ``chat:smollm2``) or a seeded random tiny Llama with a byte-level ChatML codec
  (``chat:tiny``, tests and CI) -- fine-tuned on docstring question/answer pairs of each node's
  stdlib modules (``node.tasks.instruct_data``); metric = held-out answer perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from crypto import Layout, flatten
from node.tasks import digits
from node.tasks import instruct_data as qa
from node.models.chat import ChatCodec
from node.tasks.corpus import split_corpus
from node.tasks.dp_sgd import ExampleDp, private_train
from node.tasks.general_data import general_mix
from node.models.llama import LlamaConfig, LlamaModel
from node.models.lora import LoraConfig, LoraLlamaModel, adapt
from node.tasks.lm import eval_loss, train_lm
from node.models.byte_model import ModelConfig, TinyTransformer
from node.models.interface import CachedLM

LM_MODEL = ModelConfig(n_layers=2, n_heads=2, d_model=64, context_len=128)
"""The federated LM: ~0.13 M parameters, so a round of 5 encrypted nodes takes seconds."""


class Task(Protocol):
    """What a node trains and evaluates. A task may also set, in ``evaluate``, ``base_metric``
    (the frozen base model's metric on the same data) and ``samples`` (``{"question",
    "reply"}`` dicts): the evaluate handler sends them when present (``ChatTask`` does)."""

    name: str
    metric: str
    """Name of the evaluation metric: ``accuracy`` (higher is better) or ``perplexity``."""
    default_lr: float
    num_examples: int
    train_loader: DataLoader | None
    """Per-sample data for Opacus DP-SGD (digits); None for the language tasks, which train
    privately with ``train_private`` (``node.tasks.dp_sgd``: Opacus cannot wrap their attention)."""

    def build_model(self, seed: int) -> nn.Module: ...
    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]: ...
    def evaluate(self, model: nn.Module) -> tuple[float, float, int]: ...


@dataclass
class DigitsTask:
    partition_id: int
    num_partitions: int
    seed: int = 42
    alpha: float = 1.0
    hidden: int = 64
    name: str = "digits"
    metric: str = "accuracy"
    default_lr: float = 0.3
    """Plain SGD."""

    def __post_init__(self) -> None:
        cfg = digits.DigitsConfig(
            num_partitions=self.num_partitions, alpha=self.alpha, seed=self.seed
        )
        self.train_loader, self.test_loader = digits.load_partition(self.partition_id, cfg)
        self.num_examples = len(self.train_loader.dataset)

    def build_model(self, seed: int) -> nn.Module:
        return digits.make_model(seed, self.hidden)

    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]:
        if self.train_loader.generator is not None:
            self.train_loader.generator.manual_seed(seed)
        return digits.train(model, self.train_loader, epochs, lr)

    def evaluate(self, model: nn.Module) -> tuple[float, float, int]:
        loss, acc = digits.evaluate(model, self.test_loader)
        return loss, acc, len(self.test_loader.dataset)


@dataclass
class LmTask:
    partition_id: int
    num_partitions: int
    seed: int = 42
    model_config: ModelConfig = LM_MODEL
    steps_per_epoch: int = 8
    batch_size: int = 8
    seq_len: int = 64
    eval_windows: int = 16
    name: str = "lm"
    metric: str = "perplexity"
    default_lr: float = 3e-3
    """AdamW, fresh each round."""
    train_loader: DataLoader | None = None  # DP-SGD: train_private (node.tasks.dp_sgd)
    dp_batch: int = 256
    """DP-SGD's expected Poisson batch (run-config ``dp-sgd-batch`` 0): the noise on the mean
    gradient falls as 1/batch; 256 kept the 5-node main job within ~6 % of its non-private
    perplexity at ε 8 (``experiments.example_dp_lm``)."""

    def __post_init__(self) -> None:
        split = split_corpus(self.num_partitions, seed=self.seed)
        self.share = split.shares[self.partition_id]
        self.heldout = split.heldout
        # one "example" = one training window; the weight of this node in FedAvg
        self.num_examples = max(1, len(self.share) // (self.seq_len + 1))

    def build_model(self, seed: int) -> nn.Module:
        return lm_model(seed, self.model_config)

    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]:
        model.train()
        g = torch.Generator().manual_seed(seed)
        steps = epochs * self.steps_per_epoch
        losses = train_lm(model, self.share, steps, self.batch_size, self.seq_len, lr, g)
        return (sum(losses) / len(losses) if losses else float("nan")), steps * self.batch_size

    def private_steps(self, epochs: int) -> int:
        """DP-SGD steps of one local round (what the accountant composes)."""
        return epochs * self.steps_per_epoch

    def train_private(self, model: nn.Module, epochs: int, lr: float, dp: ExampleDp,
                      generator: torch.Generator) -> float:
        """Example-level DP-SGD (``node.tasks.dp_sgd``); one example = one of the share's
        ``num_examples`` disjoint windows of ``seq_len + 1`` bytes. The mean batch loss."""
        width = self.seq_len + 1
        windows = torch.frombuffer(bytearray(self.share[:self.num_examples * width]),
                                   dtype=torch.uint8).long().view(self.num_examples, width)
        params = list(model.trainable_parameters())
        model.train()
        losses = private_train(params, lambda i: model.train_loss(windows[i:i + 1]), self.num_examples,
                               self.private_steps(epochs), dp, torch.optim.AdamW(params, lr=lr), generator)
        model.eval()
        return sum(losses) / len(losses) if losses else float("nan")

    def evaluate(self, model: nn.Module) -> tuple[float, float, int]:
        g = torch.Generator().manual_seed(self.seed)  # same windows every round: comparable
        with torch.no_grad():
            loss = eval_loss(model, self.heldout, self.seq_len, self.eval_windows, g)
        return loss, math.exp(loss), self.eval_windows * self.seq_len


CHAT_MODELS = ("smollm2", "tiny")
TINY_CHAT = LlamaConfig(vocab_size=qa.ByteChatCodec.vocab_size, hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
"""The ``chat:tiny`` base: a random Llama (fixed public seed 0) over ``ByteChatCodec``'s 258 ids."""
TINY_CHAT_CORPUS = 2 << 20
"""``chat:tiny`` reads the pairs of 2 MB of whole stdlib modules (``node.tasks.corpus`` ``max_bytes``),
not all 14 MB: a random 2-layer model learns no more from the rest, and tests stay fast."""
_BASES: dict[str, tuple[LlamaModel, ChatCodec]] = {}
"""Base models loaded in this process: every chat node of a process shares one (frozen)."""


def chat_base(model: str) -> tuple[LlamaModel, ChatCodec]:
    """The frozen base and its codec, loaded once per process. ``smollm2`` needs the converted
    model (``python -m node.models.smollm2 fetch``: ``node.models.smollm2.ModelMissingError`` says so)."""
    if model not in CHAT_MODELS:
        raise ValueError(f"unknown chat model {model!r}; use one of {CHAT_MODELS}")
    if model not in _BASES:
        if model == "tiny":
            torch.manual_seed(0)
            tiny = LlamaModel(TINY_CHAT)
            with torch.no_grad():  # HF's initializer_range: logits of a sane scale (loss ~ ln 258)
                for p in tiny.parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, 0.02)
            _BASES[model] = (tiny.eval(), qa.ByteChatCodec())
        else:
            _BASES[model] = (LlamaModel.from_pretrained(), ChatCodec.from_dir())
    return _BASES[model]


def _chat_config(model: str) -> LlamaConfig:
    """The base's geometry without its weights (the server sizes aggregates from it)."""
    if model == "tiny":
        return TINY_CHAT
    import json

    from node.models.smollm2 import FETCH_COMMAND, ModelMissingError, default_dir
    path = default_dir() / "config.json"
    if not path.is_file():
        raise ModelMissingError(f"no converted model at {default_dir()}: run {FETCH_COMMAND}")
    return LlamaConfig.from_hf(json.loads(path.read_text()))


def chat_layout_model(model: str, seed: int) -> LoraLlamaModel:
    """The adapted model on the ``meta`` device: shapes only, nothing loaded or allocated."""
    with torch.device("meta"):
        base = LlamaModel(_chat_config(model))
    return adapt(base, LoraConfig(seed=seed))


@dataclass
class ChatTask:
    partition_id: int
    num_partitions: int
    seed: int = 42
    chat_model: str = "smollm2"
    steps_per_epoch: int = 3
    """AdamW steps per local epoch (the run's ``local-epochs`` multiplies it)."""
    batch_size: int = 4
    max_len: int = 0
    """Tokens per example, longer answers cut; 0: 160 for SmolLM2 (~62 on average), 384 for
    ``tiny`` (its tokens are bytes: the templated prompt alone is ~130)."""
    eval_examples: int = 8
    """Held-out pairs each node scores per evaluation: node i the i-th slice of the held-out
    list (the same every round: comparable; 5 nodes score 40 different pairs)."""
    sample_replies: int = 2
    """Greedy replies to the first held-out questions, made by partition 0's node only."""
    sample_tokens: int = 32
    lora: LoraConfig = field(default_factory=LoraConfig)
    max_bytes: int | None = None
    """Cap on the stdlib modules the pairs come from (None: all; ``TINY_CHAT_CORPUS`` for tiny)."""
    name: str = "chat"
    metric: str = "perplexity"
    default_lr: float = 5e-3
    """AdamW on the B matrices, fresh each round."""
    train_loader: DataLoader | None = None  # DP-SGD: train_private (node.tasks.dp_sgd)
    dp_batch: int = 8
    """DP-SGD's expected Poisson batch (run-config ``dp-sgd-batch`` 0): one backward per
    example on the base model, so small (``experiments.private_finetune`` measures the trade)."""
    general_mix: float = 0.2
    """Share of the training pool that is public general instruction pairs
    (``node.tasks.general_data``, cycled), the rest this node's docstring pairs: rehearsal that keeps
    the base model's general answers (``experiments.general_mix`` measures it); 0 trains on the
    docstrings alone."""

    def __post_init__(self) -> None:
        if self.chat_model not in CHAT_MODELS:
            raise ValueError(f"unknown chat model {self.chat_model!r}; use one of {CHAT_MODELS}")
        if self.max_len <= 0:
            self.max_len = 384 if self.chat_model == "tiny" else 160
        if self.max_bytes is None and self.chat_model == "tiny":
            self.max_bytes = TINY_CHAT_CORPUS
        if not 0.0 <= self.general_mix < 1.0:
            raise ValueError(f"general_mix must be in [0, 1), got {self.general_mix}")
        self.share = qa.share_pairs(self.num_partitions, self.seed, self.partition_id, self.max_bytes)
        self.heldout = qa.heldout_pairs(self.seed, self.max_bytes)
        extra = math.ceil(len(self.share) * self.general_mix / (1.0 - self.general_mix))
        self.pool = self.share + general_mix(extra)
        """What training samples from: the share, then the general pairs (one example each:
        DP-SGD's Poisson rate is over the whole pool, which bounds each private pair's too)."""
        self.num_examples = len(self.pool)
        start = self.partition_id * self.eval_examples % len(self.heldout)
        self.eval_pairs = (self.heldout * 2)[start:start + min(self.eval_examples, len(self.heldout))]
        """This node's slice of the held-out pairs."""
        self.samples: list[dict[str, str]] = []
        """The last evaluation's greedy replies to the first held-out questions."""
        self.base_metric: float | None = None
        """The frozen base model's perplexity on ``eval_pairs`` (computed once: it never
        changes): the "round 0" the adapters are compared against."""

    @property
    def codec(self) -> ChatCodec:
        return chat_base(self.chat_model)[1]

    def build_model(self, seed: int) -> nn.Module:
        """The shared base with this run's adapters (A from the public ``seed``, B zero)."""
        return adapt(chat_base(self.chat_model)[0], replace(self.lora, seed=seed))

    def pad_id(self) -> int:
        """The id that pads a batch (the tokenizer's pad, else its EOS, else 0)."""
        tok = self.codec.tokenizer
        pad = None if tok is None else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        return 0 if pad is None else int(pad)

    def train(self, model: nn.Module, epochs: int, lr: float, seed: int) -> tuple[float, int]:
        """``epochs * steps_per_epoch`` AdamW steps on random batches of the share; the loss
        counts answer tokens only."""
        g = torch.Generator().manual_seed(seed)
        params = list(model.trainable_parameters())
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        model.train()
        losses = []
        steps = epochs * self.steps_per_epoch
        for _ in range(steps):
            idx = torch.randint(0, len(self.pool), (self.batch_size,), generator=g).tolist()
            ids, labels = qa.batch(self.codec, [self.pool[i] for i in idx], self.max_len, self.pad_id())
            loss = qa.answer_loss(model, ids, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
        model.eval()
        return sum(losses) / max(1, len(losses)), steps * self.batch_size

    def private_steps(self, epochs: int) -> int:
        """DP-SGD steps of one local round (what the accountant composes)."""
        return epochs * self.steps_per_epoch

    def train_private(self, model: nn.Module, epochs: int, lr: float, dp: ExampleDp,
                      generator: torch.Generator) -> float:
        """Example-level DP-SGD (``node.tasks.dp_sgd``) on the trained adapters; one example = one
        question/answer pair of the pool (its answer-token loss). The mean batch loss."""
        pad = self.pad_id()

        def example_loss(i: int) -> torch.Tensor:
            return qa.answer_loss(model, *qa.batch(self.codec, [self.pool[i]], self.max_len, pad))

        params = list(model.trainable_parameters())
        model.train()
        losses = private_train(params, example_loss, self.num_examples, self.private_steps(epochs), dp,
                               torch.optim.AdamW(params, lr=lr, weight_decay=0.0), generator)
        model.eval()
        return sum(losses) / len(losses) if losses else float("nan")

    def answer_loss(self, model: nn.Module) -> tuple[float, int]:
        """Mean answer-token loss on ``eval_pairs`` and the number of answer tokens."""
        total, count = 0.0, 0
        model.eval()
        with torch.no_grad():
            for i in range(0, len(self.eval_pairs), 8):
                ids, labels = qa.batch(self.codec, self.eval_pairs[i:i + 8], self.max_len, self.pad_id())
                total += float(qa.answer_loss(model, ids, labels, reduction="sum"))
                count += int((labels != qa.IGNORE).sum())
        return total / count, count

    def evaluate(self, model: nn.Module) -> tuple[float, float, int]:
        """Answer-token loss and perplexity on ``eval_pairs``; the base model's once
        (``base_metric``); partition 0 puts greedy replies to the first ``sample_replies``
        held-out questions in ``samples``."""
        if self.base_metric is None:
            self.base_metric = math.exp(self.answer_loss(chat_base(self.chat_model)[0])[0])
        loss, count = self.answer_loss(model)
        self.samples = [{"question": p.question, "reply": qa.greedy_reply(
            model, self.codec, p.question, self.sample_tokens)}
            for p in (self.heldout[:self.sample_replies] if self.partition_id == 0 else [])]
        return loss, math.exp(loss), count


def lm_model(seed: int | None = None, config: ModelConfig = LM_MODEL) -> CachedLM:
    """The node's language model (the one place that names its class), initialised from
    ``seed`` (None: torch's global generator as it is, for a model loaded afterwards)."""
    if seed is not None:
        torch.manual_seed(seed)
    return TinyTransformer(config)


def parameter_layout(model: nn.Module) -> Layout:
    """Names, shapes and order of the parameters the federation averages: a ``CachedLM``'s
    own ``parameter_layout()``, every state-dict entry of another model (the digits MLP)."""
    if isinstance(model, CachedLM):
        return model.parameter_layout()
    return flatten(model.state_dict(), check_finite=False)[1]


def federated_state(model: nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """The model's state-dict entries ``layout`` names."""
    state = model.state_dict()
    return {n: state[n] for n in layout.names}


def load_parameters(model: nn.Module, state: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Load the entries ``layout`` names from ``state`` into ``model`` (a KeyError if one is
    absent); entries outside the layout (a frozen base under adapters) keep their values.
    A name the model lacks or a shape it does not have is refused, as a strict load would."""
    _, unexpected = model.load_state_dict({n: state[n] for n in layout.names}, strict=False)
    if unexpected:
        raise KeyError(f"parameters the model does not have: {sorted(unexpected)}")


def _chat_model_of(task: str) -> str | None:
    """``chat`` -> ``smollm2``, ``chat:<model>`` -> ``<model>``; None for another task."""
    name, _, model = task.partition(":")
    return (model or "smollm2") if name == "chat" else None


def build_model(task: str, seed: int) -> nn.Module:
    """The task's model with the run's seeded init, without loading any data (the server
    sizes aggregates with it; for ``chat`` the adapters on a ``meta``-device base: shapes only)."""
    if (chat := _chat_model_of(task)) is not None:
        return chat_layout_model(chat, seed)
    if task == "lm":
        return lm_model(seed)
    if task == "digits":
        return digits.make_model(seed)
    raise ValueError(f"unknown task {task!r}; use 'digits', 'lm', 'chat' or 'chat:tiny'")


def make_task(name: str, partition_id: int, num_partitions: int, seed: int, alpha: float) -> Task:
    if (chat := _chat_model_of(name)) is not None:
        return ChatTask(partition_id, num_partitions, seed, chat_model=chat)
    if name == "digits":
        return DigitsTask(partition_id, num_partitions, seed, alpha)
    if name == "lm":
        return LmTask(partition_id, num_partitions, seed)
    raise ValueError(f"unknown task {name!r}; use 'digits', 'lm', 'chat' or 'chat:tiny'")
