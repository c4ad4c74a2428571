from hylora.cache.paged_kv import OutOfPages, PagedKVCache
from hylora.cache.state_pool import OutOfSlots, StatePool

__all__ = ["OutOfPages", "OutOfSlots", "PagedKVCache", "StatePool"]
