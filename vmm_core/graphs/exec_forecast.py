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
PRIOR_WEIGHT = 1.0


def _decay(half_life: float) -> float:
    return 0.5 ** (1.0 / half_life)


class _Aged:
    """Counts that halve every ``half_life`` steps, updated lazily (key -> value, step)."""

    __slots__ = ("decay", "counts")

    def __init__(self, half_life: float) -> None:
        self.decay = _decay(half_life)
        self.counts: dict = {}

    def bump(self, key, step: int) -> None:
        entry = self.counts.get(key)
        if entry is None:
            self.counts[key] = [1.0, step]
        else:
            entry[0] = entry[0] * self.decay ** (step - entry[1]) + 1.0
            entry[1] = step

    def value(self, key, step: int) -> float:
        entry = self.counts.get(key)
        return 0.0 if entry is None else entry[0] * self.decay ** (step - entry[1])

    def values(self, step: int) -> dict:
        return {k: v * self.decay ** (step - s) for k, (v, s) in self.counts.items()}


class _Shadow:
    """The keys one half-life's ranking would hold, and its recent misses."""

    __slots__ = ("half_life", "frequency", "held", "misses")

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.frequency = _Aged(half_life)
        self.held: set = set()
        self.misses = 0.0

    def observe(self, key, step: int, capacity: int, miss_decay: float) -> None:
        self.misses *= miss_decay
        if key not in self.held:
            self.misses += 1.0
            while len(self.held) >= capacity:
                self.held.remove(min(self.held, key=lambda k: self.frequency.value(k, step)))
            self.held.add(key)
        self.frequency.bump(key, step)


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
        self._frequency = _Aged(BET_HALF_LIFE)
        self._after: dict = {}  # key -> _Aged of the keys that followed it

    def observe(self, key) -> None:
        self.step += 1
        step = self.step
        for shadow in self._shadows:
            shadow.observe(key, step, self.capacity, self._miss_decay)
        self._frequency.bump(key, step)
        if self.last is not None:
            after = self._after.get(self.last)
            if after is None:
                after = self._after[self.last] = _Aged(BET_HALF_LIFE)
            after.bump(key, step)
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
        return self._best().frequency.value(key, self.step)

    def ranks(self) -> dict:
        """:meth:`rank` of every key seen, at once."""
        return self._best().frequency.values(self.step)

    def chances(self) -> dict:
        """P(the next block is key) for every key seen: the transitions out of the last
        key, with the aged frequency of every key as a prior."""
        frequency = self._frequency.values(self.step)
        total = sum(frequency.values())
        if total <= 0.0:
            return {}
        after_aged = self._after.get(self.last)
        after = after_aged.values(self.step) if after_aged is not None else {}
        norm = sum(after.values()) + PRIOR_WEIGHT
        return {k: (after.get(k, 0.0) + PRIOR_WEIGHT * f / total) / norm
                for k, f in frequency.items()}

    def bets(self, at_least: float, limit: int = 2,
             chances: dict | None = None) -> list[tuple[object, float]]:
        """The keys the next block is at least ``at_least`` likely to be, likeliest first,
        at most ``limit`` of them: ``[(key, chance), ...]`` (``chances``: what
        :meth:`chances` returned now, if at hand)."""
        chances = self.chances() if chances is None else chances
        ranked = sorted(chances.items(), key=lambda kv: -kv[1])
        return [(k, p) for k, p in ranked[:limit] if p >= at_least]
