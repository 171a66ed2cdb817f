"""Which keys of a GraphPool the next replay blocks will open: what a budget of executables
is spent by when the policy prepares ahead (``ExecutablePolicy(ahead=True)``).

A serving engine's batch sizes follow no one law.  Under a steady mixed load a few sizes
are hot (Zipf-like), under continuous batching the batch drifts by a little per step (a
random walk), and a stress test draws them uniformly.  Which key to give up first differs:
frequency wins when a few keys are hot, recency when the batch drifts.  On the three
traces of the benchmark with a budget of 13 of 51 keys (host simulation), key misses per
step: the optimum (Belady) 0.24 / 0.05 / 0.44 for Zipf / drift / uniform; least recently
used 0.41 / 0.05 / 0.75; frequency with a half-life of 512 steps 0.31 / 0.21 / 0.74; the
shadows below 0.31 / 0.05 / 0.74, and on a drift that turns into a Zipf load better than
any one half-life (0.20 against 0.21 at best).

So the forecast keeps **shadows**: for each half-life, the keys an aged-frequency ranking
with that half-life would hold in a budget of as many keys as the real one, and how often
it missed lately.  Keys are ranked for eviction by the shadow that missed least.

What comes *next* (a prefetch without the engine's hint) is bet on from the aged
transitions out of the key replayed last, blended with the aged frequency of every key: a
random walk's neighbours, or the hot keys of a Zipf load.  Nothing here takes a lock; the
executable cache calls it under its own.
"""

from __future__ import annotations

__all__ = ["KeyForecast", "HALF_LIVES", "MISS_HALF_LIFE"]

#: the half-lives (in replay blocks) of the shadows: from least recently used to least
#: frequently used
HALF_LIVES = (2.0, 8.0, 32.0, 128.0, 512.0)
#: how fast a shadow's misses are forgotten (blocks): the ranking follows a changed load
MISS_HALF_LIFE = 64.0
#: half-life of the transitions and the frequency a next-key bet is made from
BET_HALF_LIFE = 32.0
#: weight of the frequency prior against the transitions out of the last key
PRIOR_WEIGHT = 2.0


def _decay(half_life: float) -> float:
    return 0.5 ** (1.0 / half_life)


class _Aged:
    """Counts that halve every ``half_life`` steps, at one multiplication a step.

    A use at step ``t`` adds ``growth ** t`` (``growth = 2 ** (1 / half_life)``), so a
    count divided by ``growth ** now`` is the aged count, and counts compare as aged
    counts do without being aged one by one.  Tables (key -> count) registered here share
    the scale, which is brought back to 1 before it overflows."""

    __slots__ = ("growth", "weight", "tables")

    def __init__(self, half_life: float) -> None:
        self.growth = 2.0 ** (1.0 / half_life)
        self.weight = 1.0
        self.tables: list[dict] = []

    def table(self) -> dict:
        table: dict = {}
        self.tables.append(table)
        return table

    def tick(self) -> None:
        self.weight *= self.growth
        if self.weight > 1e100:
            for table in self.tables:
                for key in table:
                    table[key] /= self.weight
            self.weight = 1.0

    def bump(self, table: dict, key) -> None:
        table[key] = table.get(key, 0.0) + self.weight

    def value(self, table: dict, key) -> float:
        return table.get(key, 0.0) / self.weight


class _Shadow:
    """The keys one half-life's ranking would hold, and its recent misses."""

    __slots__ = ("half_life", "aged", "counts", "held", "misses")

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.aged = _Aged(half_life)
        self.counts = self.aged.table()
        self.held: set = set()
        self.misses = 0.0

    def observe(self, key, capacity: int, miss_decay: float) -> None:
        self.aged.tick()
        self.misses *= miss_decay
        if key not in self.held:
            self.misses += 1.0
            counts = self.counts
            while len(self.held) >= capacity:
                self.held.remove(min(self.held, key=counts.__getitem__))
            self.held.add(key)
        self.aged.bump(self.counts, key)


#: how many most frequent keys are kept at hand for the bets
TOP = 4


def _keep_top(top: list, counts: dict, key) -> None:
    """``top`` (the most counted keys of ``counts``, most first, at most :data:`TOP`)
    after ``key``'s count grew."""
    if key in top:
        top.remove(key)
    elif len(top) >= TOP and counts[key] <= counts[top[-1]]:
        return
    i = 0
    while i < len(top) and counts[top[i]] >= counts[key]:
        i += 1
    top.insert(i, key)
    del top[TOP:]


class KeyForecast:
    """The replay blocks seen so far, and what they say of the next ones.

    :meth:`observe` once per replay block (its key); :meth:`rank` orders keys for
    eviction (lower goes first); :meth:`bets` names the keys the next block is likely to
    be.  ``capacity`` is how many keys the budget holds (the cache sets it)."""

    def __init__(self, half_lives=HALF_LIVES, miss_half_life: float = MISS_HALF_LIFE) -> None:
        self.step = 0
        self.last = None
        self.capacity = 1
        self._shadows = [_Shadow(h) for h in half_lives]
        self._miss_decay = _decay(miss_half_life)
        self._bet = _Aged(BET_HALF_LIFE)
        self._frequency = self._bet.table()
        self._after: dict = {}  # key -> the aged counts of the keys that followed it
        # the most frequent keys, overall and after each key: a count only grows when
        # its key is used (the scale is common), so one comparison keeps them
        self._top: list = []
        self._top_after: dict = {}

    def observe(self, key) -> None:
        self.step += 1
        for shadow in self._shadows:
            shadow.observe(key, self.capacity, self._miss_decay)
        bet = self._bet
        bet.tick()
        bet.bump(self._frequency, key)
        _keep_top(self._top, self._frequency, key)
        if self.last is not None:
            after = self._after.get(self.last)
            if after is None:
                after = self._after[self.last] = bet.table()
                self._top_after[self.last] = []
            bet.bump(after, key)
            _keep_top(self._top_after[self.last], after, key)
        self.last = key

    def _best(self) -> _Shadow:
        """The shadow that missed least lately (ties: the middle one, where nothing is
        known yet)."""
        middle = self._shadows[len(self._shadows) // 2]
        return min(self._shadows, key=lambda s: (s.misses, s is not middle))

    @property
    def half_life(self) -> float:
        return self._best().half_life

    def rank(self, key) -> float:
        """How much ``key`` is worth keeping: its aged frequency under the best shadow's
        half-life (a key never seen: 0)."""
        shadow = self._best()
        return shadow.aged.value(shadow.counts, key)

    def ranks(self) -> dict:
        """:meth:`rank` of every key seen, at once."""
        shadow = self._best()
        weight = shadow.aged.weight
        return {k: c / weight for k, c in shadow.counts.items()}

    def chance(self, key) -> float:
        """P(the next block is ``key``): the transitions out of the last key, with the
        aged frequency of every key as a prior."""
        return self._chances((key,)).get(key, 0.0)

    def _chances(self, keys) -> dict:
        frequency = self._frequency
        total = sum(frequency.values())
        if total <= 0.0:
            return {}
        weight = self._bet.weight
        after = self._after.get(self.last) or {}
        norm = sum(after.values()) / weight + PRIOR_WEIGHT
        prior = PRIOR_WEIGHT / total
        return {k: (after.get(k, 0.0) / weight + prior * frequency.get(k, 0.0)) / norm
                for k in keys}

    def bets(self, at_least: float, limit: int = 2) -> list[tuple[object, float]]:
        """The keys the next block is at least ``at_least`` likely to be, likeliest first,
        at most ``limit`` of them: ``[(key, chance), ...]``.  Only the keys that followed
        the last one most and the most frequent can lead, so only they are weighed."""
        if not self._frequency:
            return []
        candidates = set(self._top[:limit]) | set(self._top_after.get(self.last, ())[:limit])
        ranked = sorted(self._chances(candidates).items(), key=lambda kv: -kv[1])
        return [(k, p) for k, p in ranked[:limit] if p >= at_least]
