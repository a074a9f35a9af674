"""Pure routing policies of ``kvxfer proxy``: no I/O, no clock, no event loop.

Everything the proxy decides per request lives here so it can be unit-tested with
plain objects:

- :func:`extract_prompt` reads the prompt out of an OpenAI ``/v1/completions`` or
  ``/v1/chat/completions`` body and estimates its token count
  (:class:`TokenEstimator`: a tokenizer when given, else characters / ``chars_per_token``).
- :class:`Decider` chooses between prefill/decode (P/D) and sending the request
  straight to a decode instance (short prompts, batched prompts, parallel sampling).
- :class:`PrefillPolicy` picks a prefill instance: least outstanding prompt tokens,
  with prefix affinity from a :class:`PrefixIndex` (chained hashes of the prompt's
  leading blocks → the instances that prefilled them) as long as the affine
  instance's load is within a slack of the least loaded one.
- :class:`DecodePolicy` picks the decode instance with the fewest active requests.
- :class:`Instance` carries per-instance health and load; :meth:`Instance.observe`
  is the health state machine (``fall`` failures out, ``rise`` successes back).

Unhealthy instances are never returned by a policy.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "AffinityResult",
    "Decider",
    "Decision",
    "DecodePolicy",
    "Instance",
    "InstanceKind",
    "InstanceState",
    "PrefillChoice",
    "PrefillPolicy",
    "PrefixIndex",
    "PromptInfo",
    "Reason",
    "Route",
    "TokenEstimator",
    "extract_prompt",
]


class InstanceKind(enum.Enum):
    """What an instance does for the proxy."""

    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(enum.Enum):
    """Whether an instance is in rotation."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class Route(enum.Enum):
    """How one request is served."""

    PD = "pd"  # prefill instance first (or alongside, push), then decode
    DECODE_ONLY = "decode_only"  # the whole request on one decode instance


class Reason(enum.Enum):
    """Why the decider chose its route (a label of ``kvxfer_proxy_decisions_total``)."""

    PD = "pd"
    SHORT_PROMPT = "short_prompt"
    MULTI_PROMPT = "multi_prompt"
    PARALLEL_SAMPLING = "parallel_sampling"
    NO_PREFILL = "no_prefill_instances"
    PREFILL_UNAVAILABLE = "prefill_unavailable"


class AffinityResult(enum.Enum):
    """What prefix affinity contributed to a prefill pick."""

    HIT = "hit"  # went to an instance that prefilled the same leading blocks
    OVERLOADED = "overloaded"  # such an instance exists but is beyond the slack
    MISS = "miss"  # no instance known for this prefix
    NONE = "none"  # affinity off, or the prompt is shorter than one block


@dataclasses.dataclass(eq=False)
class Instance:
    """One vLLM instance behind the proxy, with its health and load.

    Attributes:
        url: Base URL, e.g. ``http://127.0.0.1:8100`` (no trailing slash).
        kind: Prefill or decode.
        state: In rotation or not. Instances start UNHEALTHY until a check passes.
        active: Requests in flight to this instance.
        outstanding_tokens: Estimated prompt tokens in flight (prefill routing).
        fails: Consecutive failed health observations.
        passes: Consecutive passed health observations.
        last_error: The latest failure, for ``/stats`` ("" when none).
        requests_total: Requests sent to this instance.
        errors_total: Requests to this instance that failed.
        kv_endpoint: The side-channel coordinates learned from this (prefill)
            instance's ``kv_transfer_params`` (push mode sends them to decode).
    """

    url: str
    kind: InstanceKind
    state: InstanceState = InstanceState.UNHEALTHY
    active: int = 0
    outstanding_tokens: int = 0
    fails: int = 0
    passes: int = 0
    last_error: str = "not checked yet"
    requests_total: int = 0
    errors_total: int = 0
    kv_endpoint: dict[str, Any] | None = None

    @property
    def healthy(self) -> bool:
        """True when the instance is in rotation."""
        return self.state is InstanceState.HEALTHY

    def observe(self, ok: bool, error: str = "", *, fall: int = 1, rise: int = 1) -> bool:
        """Fold one health observation in; returns True when the state changed.

        Args:
            ok: The check (or request) succeeded.
            error: What failed, kept in :attr:`last_error`.
            fall: Consecutive failures that take a healthy instance out.
            rise: Consecutive successes that put an unhealthy instance back.
        """
        if ok:
            self.passes += 1
            self.fails = 0
            if not self.healthy and self.passes >= rise:
                self.state = InstanceState.HEALTHY
                self.last_error = ""
                return True
            return False
        self.fails += 1
        self.passes = 0
        self.last_error = error or "health check failed"
        if self.healthy and self.fails >= fall:
            self.state = InstanceState.UNHEALTHY
            self.kv_endpoint = None  # a restarted engine comes back with a new identity
            return True
        return False

    def acquire(self, tokens: int = 0) -> None:
        """Count one request (of ``tokens`` estimated prompt tokens) in flight."""
        self.active += 1
        self.outstanding_tokens += tokens
        self.requests_total += 1

    def release(self, tokens: int = 0) -> None:
        """Undo :meth:`acquire` once the request left this instance."""
        self.active = max(0, self.active - 1)
        self.outstanding_tokens = max(0, self.outstanding_tokens - tokens)


# -- prompts ---------------------------------------------------------------------------


class PromptInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The prompt of one request as the policies see it.

    Attributes:
        text: Canonical prompt text (chat: role and content of each message), or ""
            for a token-id prompt.
        token_ids: The prompt's token ids when the client sent ids, else None.
        num_prompts: Prompts in the request (a batched ``/v1/completions`` has > 1).
        tokens: Estimated prompt tokens (exact for token ids).
    """

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    num_prompts: int = 1
    tokens: int = 0


class TokenEstimator:
    """Counts prompt tokens cheaply.

    Args:
        chars_per_token: Characters per token when no tokenizer is given (4 is a fair
            average for English BPE vocabularies).
        tokenizer: Optional ``str -> token count`` (e.g. a ``tokenizers.Tokenizer``'s
            ``len(encode(text).ids)``); exact, and slower on very long prompts.
    """

    def __init__(
        self, chars_per_token: float = 4.0, tokenizer: Callable[[str], int] | None = None
    ) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token={chars_per_token!r}: must be > 0")
        self.chars_per_token = chars_per_token
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        """Estimated tokens of ``text`` (at least 1 for non-empty text)."""
        if not text:
            return 0
        if self.tokenizer is not None:
            return int(self.tokenizer(text))
        return max(1, round(len(text) / self.chars_per_token))


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    parts: list[str] = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise ValueError("each message must be an object")
        content = msg.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url"...}]
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"{msg.get('role', '')}\x1f{content or ''}\x1e")
    return "".join(parts)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def extract_prompt(body: Mapping[str, Any], *, chat: bool, estimator: TokenEstimator) -> PromptInfo:
    """Read the prompt of a completions (``chat=False``) or chat request.

    Raises:
        ValueError: The body has no usable prompt (the proxy answers 400).
    """
    if chat:
        text = _chat_text(body.get("messages"))
        # ~4 tokens of chat-template framing per message.
        framing = 4 * len(body.get("messages") or ())
        return PromptInfo(text=text, tokens=estimator.count(text) + framing)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptInfo(text=prompt, tokens=estimator.count(prompt))
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            ids = tuple(int(t) for t in prompt)
            return PromptInfo(token_ids=ids, tokens=len(ids))
        if len(prompt) == 1:  # a batch of one is one prompt
            return extract_prompt({"prompt": prompt[0]}, chat=False, estimator=estimator)
        if all(isinstance(p, str) for p in prompt):
            tokens = sum(estimator.count(p) for p in prompt)
            return PromptInfo(text=prompt[0], num_prompts=len(prompt), tokens=tokens)
        if all(_is_ids(p) for p in prompt):
            tokens = sum(len(p) for p in prompt)
            return PromptInfo(token_ids=tuple(prompt[0]), num_prompts=len(prompt), tokens=tokens)
    raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")


# -- decider ---------------------------------------------------------------------------


class Decision(msgspec.Struct, frozen=True):
    """The decider's verdict for one request."""

    route: Route
    reason: Reason


class Decider:
    """P/D or decode-only, per request.

    P/D pays for itself on long prompts; for a short one the KV hand-off costs more
    than the prefill it moves, so it goes straight to a decode instance. Requests that
    vLLM cannot serve through one KV hand-off (several prompts in one completions call,
    or ``n``/``best_of`` > 1, whose samples would all claim the same remote blocks) are
    served whole by a decode instance as well.

    Args:
        short_prompt_tokens: Prompts with fewer estimated tokens skip P/D; 0 disables.
    """

    def __init__(self, short_prompt_tokens: int = 0) -> None:
        if short_prompt_tokens < 0:
            raise ValueError(f"short_prompt_tokens={short_prompt_tokens!r}: must be >= 0")
        self.short_prompt_tokens = short_prompt_tokens

    def decide(
        self, prompt: PromptInfo, body: Mapping[str, Any], *, have_prefill: bool = True
    ) -> Decision:
        """Choose the route of one request.

        Args:
            prompt: The request's prompt.
            body: The request body (``n`` and ``best_of`` are read).
            have_prefill: Whether any prefill instance is configured.
        """
        if not have_prefill:
            return Decision(Route.DECODE_ONLY, Reason.NO_PREFILL)
        if prompt.num_prompts > 1:
            return Decision(Route.DECODE_ONLY, Reason.MULTI_PROMPT)
        for key in ("n", "best_of"):
            value = body.get(key)
            if isinstance(value, int) and value > 1:
                return Decision(Route.DECODE_ONLY, Reason.PARALLEL_SAMPLING)
        if self.short_prompt_tokens and prompt.tokens < self.short_prompt_tokens:
            return Decision(Route.DECODE_ONLY, Reason.SHORT_PROMPT)
        return Decision(Route.PD, Reason.PD)


# -- prefix affinity -------------------------------------------------------------------


class PrefixIndex:
    """Which prefill instances saw which leading prompt blocks (an LRU map).

    A prompt is cut into blocks of ``block_chars`` characters (token-id prompts: blocks
    of ``block_tokens`` ids); block *i*'s key hashes block *i* together with key *i-1*,
    so a key stands for the whole prefix up to it, as vLLM's prefix cache does. Only
    whole blocks count: a prompt shorter than one block has no key.

    Args:
        block_chars: Characters per block of a text prompt.
        block_tokens: Token ids per block of a token-id prompt.
        max_blocks: Leading blocks considered (bounds the hashing per request).
        capacity: Keys remembered; the least recently used go first.
    """

    def __init__(
        self,
        *,
        block_chars: int = 256,
        block_tokens: int = 64,
        max_blocks: int = 64,
        capacity: int = 65536,
    ) -> None:
        for name, value in (
            ("block_chars", block_chars),
            ("block_tokens", block_tokens),
            ("max_blocks", max_blocks),
            ("capacity", capacity),
        ):
            if value < 1:
                raise ValueError(f"{name}={value!r}: must be >= 1")
        self.block_chars = block_chars
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._owners: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def keys(self, prompt: PromptInfo) -> list[bytes]:
        """The chained block keys of ``prompt`` (empty when shorter than one block)."""
        chunks: list[bytes] = []
        if prompt.token_ids is not None:
            ids, n = prompt.token_ids, self.block_tokens
            for i in range(min(len(ids) // n, self.max_blocks)):
                block = ids[i * n : (i + 1) * n]
                chunks.append(struct.pack(f"<{n}q", *block))
        else:
            text, n = prompt.text, self.block_chars
            for i in range(min(len(text) // n, self.max_blocks)):
                chunks.append(text[i * n : (i + 1) * n].encode("utf-8", "surrogatepass"))
        keys: list[bytes] = []
        prev = b""
        for chunk in chunks:
            prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
            keys.append(prev)
        return keys

    def match(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Instance URL -> how many leading blocks of ``keys`` it holds (> 0 only)."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            owners = self._owners.get(key)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for url in alive:
                depth[url] = i + 1
        return depth

    def record(self, keys: Sequence[bytes], url: str) -> None:
        """Remember that ``url`` now holds the prefix behind every key in ``keys``."""
        for key in keys:
            owners = self._owners.get(key)
            if owners is None:
                self._owners[key] = {url}
            else:
                owners.add(url)
                self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget(self, url: str) -> None:
        """Drop ``url`` everywhere (it restarted or left: its prefix cache is gone)."""
        for key in list(self._owners):
            owners = self._owners[key]
            owners.discard(url)
            if not owners:
                del self._owners[key]


# -- policies --------------------------------------------------------------------------


class PrefillChoice(msgspec.Struct, frozen=True):
    """A prefill pick and what affinity contributed to it."""

    instance: Instance
    affinity: AffinityResult
    depth: int = 0


class _Rotor:
    """Spreads ties: successive calls start at successive positions."""

    def __init__(self) -> None:
        self._n = 0

    def pick(self, ties: Sequence[Instance]) -> Instance:
        choice = ties[self._n % len(ties)]
        self._n += 1
        return choice


class PrefillPolicy:
    """Least outstanding prompt tokens, with prefix affinity.

    Among healthy instances: if some hold leading blocks of this prompt and the best of
    them (deepest match, then least loaded) carries at most ``slack_tokens`` more
    outstanding prompt tokens than the least loaded instance, it gets the request (its
    prefix cache saves that prefill work); otherwise the least loaded instance does.
    The pick is recorded in the index.

    Args:
        index: The prefix index; None disables affinity.
        slack_tokens: How much extra load an affine instance may carry and still win.
    """

    def __init__(self, index: PrefixIndex | None = None, slack_tokens: int = 4096) -> None:
        if slack_tokens < 0:
            raise ValueError(f"slack_tokens={slack_tokens!r}: must be >= 0")
        self.index = index
        self.slack_tokens = slack_tokens
        self._rotor = _Rotor()

    def pick(
        self, instances: Sequence[Instance], keys: Sequence[bytes] = ()
    ) -> PrefillChoice | None:
        """The instance for a prompt with affinity ``keys``; None when none is healthy."""
        healthy = [i for i in instances if i.healthy]
        if not healthy:
            return None
        least = min(i.outstanding_tokens for i in healthy)
        result, depth = AffinityResult.NONE, 0
        chosen: Instance | None = None
        if self.index is not None and keys:
            matches = self.index.match(keys)
            affine = [i for i in healthy if matches.get(i.url, 0) > 0]
            if not affine:
                result = AffinityResult.MISS
            else:
                best = max(matches[i.url] for i in affine)
                deepest = [i for i in affine if matches[i.url] == best]
                load = min(i.outstanding_tokens for i in deepest)
                if load <= least + self.slack_tokens:
                    ties = [i for i in deepest if i.outstanding_tokens == load]
                    chosen, result, depth = self._rotor.pick(ties), AffinityResult.HIT, best
                else:
                    result = AffinityResult.OVERLOADED
        if chosen is None:
            chosen = self._rotor.pick([i for i in healthy if i.outstanding_tokens == least])
        if self.index is not None and keys:
            self.index.record(keys, chosen.url)
        return PrefillChoice(chosen, result, depth)


class DecodePolicy:
    """Fewest active requests among healthy decode instances (ties spread)."""

    def __init__(self) -> None:
        self._rotor = _Rotor()

    def pick(self, instances: Sequence[Instance]) -> Instance | None:
        """The decode instance for the next request; None when none is healthy."""
        healthy = [i for i in instances if i.healthy]
        if not healthy:
            return None
        least = min(i.active for i in healthy)
        return self._rotor.pick([i for i in healthy if i.active == least])
