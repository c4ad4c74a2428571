"""Prefix caching for the hybrid model: a request resumes from the longest cached prefix of its prompt.

A Gated DeltaNet layer's state summarises the whole prefix, so reusing attention KV alone is not
enough: an entry holds, for a prefix of L tokens, a snapshot of every GDN layer's recurrent and conv
state after token L (in a pool of its own, `snapshots`) and references to the KV pages that hold
tokens [0, L). A request that finds an entry copies the snapshot into its own state slot, shares
the entry's full KV pages (read-only: it writes only from L on) and gets a copy of the partly filled
last page, and its prefill starts at L.

Where snapshots are taken (a state is ~75-150 MB at the 27B shape, so not at every block): at the
prompt's turn and media boundaries — before the last `<|im_start|>` (everything but the generation
turn: the next turn of the same conversation starts with it), before the one preceding it (a shared
system prompt and earlier turns), and after the last `<|vision_end|>` (the same image or video asked
another question); a prompt with none of these (a raw completion) at its last 64-token boundary; a
request that resumed from the cache only before its last `<|im_start|>`. A prefill chunk is cut at
these points so that the state exists there (each cut costs the request one more prefill step);
the snapshot is a device copy queued right behind that step's forward, and the entry is committed
only once the step is known finite (a faulted request leaves no entry).

Keys make wrong reuse impossible: an entry matches only the same tokens (compared, not only
hashed), the same adapter version (a reloaded adapter is a new version), the same media contents
before L (`items[i].key`: content and preprocessing) and the same `cache_salt` (vLLM's request field:
tenants with different salts never share an entry, so none can time another's prompts). Requests that ask for prompt
logprobs do not look up (vLLM's rule: a cached prefix has no logits) but do fill the cache.

Eviction is LRU, by entries: an entry evicted gives back its snapshot and its page references;
a page is free once no entry and no request holds it. Pages in use are never freed.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hylora.cache import PagedKVCache, StatePool
from hylora.engine.request import Request

log = logging.getLogger(__name__)
RAW_BOUNDARY = 64  # a prompt without turn or media tokens is cached at its last multiple of this


@dataclass(eq=False)
class CacheEntry:
    key: int
    tokens: tuple[int, ...]  # the prefix itself (hash collisions cannot cause reuse)
    scope: tuple  # (adapter (name, version) or None for the base model, cache_salt or None)
    media: tuple  # content keys of the media items that start before the end of the prefix
    pages: list[int]  # KV pages holding tokens [0, len(tokens)), referenced
    snapshot: int  # slot in the snapshot pool

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class PendingSnapshot:
    """A snapshot queued behind a step; committed once that step is known finite."""

    request: Request
    entry: CacheEntry


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    by_adapter: Counter = field(default_factory=Counter)  # adapter ("" = base) → hit tokens
    queries_by_adapter: Counter = field(default_factory=Counter)

    def forget_adapters(self, keep: set[str]) -> None:
        """Drop the per-adapter counts of adapters not in `keep`."""
        for table in (self.by_adapter, self.queries_by_adapter):
            for name in [n for n in table if n not in keep]:
                del table[name]


class PrefixCache:
    def __init__(
        self,
        kv: PagedKVCache,
        states: StatePool,
        snapshots: StatePool,
        turn_token: int | None = None,
        media_end_token: int | None = None,
    ):
        """`turn_token`: the id of `<|im_start|>`, `media_end_token` of `<|vision_end|>` (None: the
        tokenizer has none)."""
        self.kv, self.states, self.snapshots = kv, states, snapshots
        self.turn_token, self.media_end_token = turn_token, media_end_token
        self.page_size = kv.page_size
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # least recently used first
        self._lengths: list[int] = []  # sorted, with repeats: the lengths of the entries
        self._free_snapshots = list(range(snapshots.num_slots - 1, -1, -1))
        self._page_refs: Counter = Counter()  # page → references held by entries (committed or pending)
        self.stats = PrefixCacheStats()

    @property
    def idle_pages(self) -> int:
        """Pages only the cache holds: evictable, so they count as free to the outside."""
        return sum(1 for page, refs in self._page_refs.items() if self.kv.references(page) == refs)

    def __len__(self) -> int:
        return len(self._entries)

    # --- lookup ----------------------------------------------------------------------------
    def attach(self, req: Request) -> int:
        """Resume `req` from the longest cached prefix of its prompt: its state slot (allocated by
        the caller) gets the snapshot, its pages the entry's, num_computed the prefix length.
        Returns the tokens reused (0 on a miss). Needs one free KV page for a partly filled last page."""
        if req.params.prompt_logprobs is not None or req.num_computed:
            return 0
        label = req.adapter or ""
        prompt_len = len(req.prompt_ids)
        self.stats.queries += prompt_len
        self.stats.queries_by_adapter[label] += prompt_len
        entry = self._longest_match(req)
        if entry is None:
            return 0
        full, partial = divmod(entry.length, self.page_size)
        pages = entry.pages[:full]
        if partial:  # the last page is shared only up to `partial` rows: the request writes past them
            if self.kv.num_free == 0:
                return 0
            (own,) = self.kv.allocate(1)
            self.kv.copy_page(entry.pages[full], own, partial)
            pages = [*pages, own]
        self.kv.retain(entry.pages[:full])
        self.snapshots.copy_to(self.states, entry.snapshot, req.state_slot)
        req.pages = pages
        req.num_computed = req.num_cached_tokens = entry.length
        self._entries.move_to_end(entry.key)
        self.stats.hits += entry.length
        self.stats.by_adapter[label] += entry.length
        return entry.length

    def _longest_match(self, req: Request) -> CacheEntry | None:
        prompt = req.prompt_ids
        scope = _scope(req)
        hashes = self._page_hashes(prompt, scope)
        end = bisect.bisect_left(self._lengths, len(prompt))  # at least one token must be computed
        for length in sorted(set(self._lengths[:end]), reverse=True):
            media = _media_before(req, length)
            entry = self._entries.get(_key(hashes, prompt, length, self.page_size, media))
            if (
                entry is not None
                and entry.scope == scope
                and entry.media == media
                and entry.tokens == tuple(prompt[:length])
            ):
                return entry
        return None

    # --- recording -------------------------------------------------------------------------
    def snapshot_points(self, req: Request) -> list[int]:
        """The prompt positions past what the request reuses (token counts, sorted, inside the prompt)
        whose state is worth keeping. A request that resumed from the cache keeps only the start of
        its generation turn (the next turn's prefix): each point costs it one more prefill step."""
        prompt, reused = req.prompt_ids, req.num_computed
        turns = [i for i, t in enumerate(prompt) if t == self.turn_token] if self.turn_token is not None else []
        media = [i + 1 for i, t in enumerate(prompt) if t == self.media_end_token] if self.media_end_token else []
        points = set(turns[-1:]) if reused else set(turns[-2:] + media[-1:])
        if not points:
            points = {(len(prompt) - 1) // RAW_BOUNDARY * RAW_BOUNDARY}
        return sorted(p for p in points if reused < p < len(prompt))

    def snapshot(self, req: Request, length: int) -> PendingSnapshot | None:
        """Queue a copy of `req`'s state (which holds its first `length` tokens) and reference the
        pages of those tokens; None when it is cached already or no snapshot slot can be freed."""
        scope = _scope(req)
        media = _media_before(req, length)
        prompt = req.prompt_ids
        key = _key(self._page_hashes(prompt, scope), prompt, length, self.page_size, media)
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        if not self._free_snapshots and not self._evict_one():
            return None
        slot = self._free_snapshots.pop()
        self.states.copy_to(self.snapshots, req.state_slot, slot)
        pages = req.pages[: self.kv.pages_needed(length)]
        self.kv.retain(pages)
        self._page_refs.update(pages)
        entry = CacheEntry(key, tuple(prompt[:length]), scope, media, list(pages), slot)
        return PendingSnapshot(req, entry)

    def commit(self, pending: PendingSnapshot) -> None:
        entry = pending.entry
        if entry.key in self._entries:  # another request cached the same prefix meanwhile
            self._release(entry)
            return
        self._entries[entry.key] = entry
        bisect.insort(self._lengths, entry.length)

    def drop(self, pending: PendingSnapshot) -> None:
        self._release(pending.entry)

    # --- eviction --------------------------------------------------------------------------
    def free_pages(self, needed: int) -> bool:
        """Evict least recently used entries until `needed` KV pages are free; False if it cannot."""
        while self.kv.num_free < needed:
            if not self._evict_one():
                return False
        return True

    def forget_pages(self, pages: Sequence[int]) -> None:
        """Drop every entry that references one of `pages` (a request that held them faulted)."""
        suspect = set(pages)
        for key in [k for k, e in self._entries.items() if suspect.intersection(e.pages)]:
            self._remove(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)

    def _evict_one(self) -> bool:
        if not self._entries:
            return False
        self._remove(next(iter(self._entries)))
        return True

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._lengths.pop(bisect.bisect_left(self._lengths, entry.length))
        self._release(entry)

    def _release(self, entry: CacheEntry) -> None:
        self.kv.release(entry.pages)
        self._page_refs.subtract(entry.pages)
        self._page_refs = +self._page_refs  # drop the pages no entry holds any more
        self._free_snapshots.append(entry.snapshot)

    # --- keys ------------------------------------------------------------------------------
    def _page_hashes(self, tokens: Sequence[int], scope: tuple) -> list[int]:
        """Chained hashes of the full pages of `tokens` (hashes[k]: the first k pages), rooted in the
        request's scope (adapter identity and cache salt)."""
        hashes = [hash(("hylora-prefix", scope))]
        size = self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            hashes.append(hash((hashes[-1], tuple(tokens[start : start + size]))))
        return hashes


def _key(hashes: list[int], tokens: Sequence[int], length: int, page_size: int, media: tuple) -> int:
    full = length // page_size
    return hash((hashes[full], tuple(tokens[full * page_size : length]), length, media))


def _scope(req: Request) -> tuple:
    """What an entry must share with a request besides its tokens and media: the adapter version and
    the cache salt."""
    return (_adapter_identity(req), req.cache_salt)


def _adapter_identity(req: Request) -> tuple[str, int] | None:
    """The adapter and its loaded version (a reload makes a new version: never a hit on the old)."""
    if req.adapter is None:
        return None
    version = req.lora.version if req.lora is not None else req.prepared.version if req.prepared else None
    return (req.adapter, version.version if version is not None else -1)


def _media_before(req: Request, length: int) -> tuple:
    """Content keys of the media items whose tokens start before `length` (in prompt order)."""
    mm = req.mm
    if mm is None:
        return ()
    starts: dict[int, int] = {}
    for seg in mm.segments:
        starts[seg.item] = min(starts.get(seg.item, seg.start), seg.start)
    return tuple(mm.items[i].key for i, start in sorted(starts.items(), key=lambda kv: kv[1]) if start < length)
