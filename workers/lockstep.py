"""Turn-by-turn lockstep for the synchronous baseline's batch of episodes (Redis).

A batch step loop, DART's synchronous baseline, resets a batch of environments, asks the
policy for every live episode's next action at once, steps them all, and only then asks
again: every turn waits for the slowest environment, and an episode that has ended idles
until the batch is done. `RedisLockstep.turn(i)` is that wait: it returns once every member
of the round has either reached turn i or ended before it. Members are separate env worker
processes, so the barrier lives in Redis (keys expire after an hour).

A member that never arrives (its worker died) would hold the others forever; after
`timeout_s` the waiters log which turn and how many arrived, and stop waiting for the rest
of the round.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("dartboard.lockstep")

KEY_TTL_S = 3600


class RedisLockstep:
    def __init__(
        self, *, redis_url: str, key: str, members: int, timeout_s: float, poll_s: float = 0.02
    ) -> None:
        import redis

        if members < 1:
            raise ValueError(f"a lockstep round needs at least one member, got {members}")
        self.redis = redis.Redis.from_url(redis_url)
        self.key = key
        self.members = members
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.last_turn = -1  # the last turn this member arrived at (-1: none yet)
        self.left = False
        self.broken = False  # a member failed to arrive in time: no more waiting this round

    def _arrived(self, index: int) -> int:
        pipe = self.redis.pipeline()
        pipe.get(f"{self.key}:at:{index}")
        pipe.hgetall(f"{self.key}:left")
        at, left = pipe.execute()
        ended_before = sum(int(n) for turn, n in left.items() if int(turn) < index)
        return int(at or 0) + ended_before

    def turn(self, index: int) -> None:
        """Arrive at turn `index` and wait until every member is there or has ended."""
        pipe = self.redis.pipeline()
        pipe.incr(f"{self.key}:at:{index}")
        pipe.expire(f"{self.key}:at:{index}", KEY_TTL_S)
        pipe.execute()
        self.last_turn = index
        deadline = time.monotonic() + self.timeout_s
        while not self.broken:
            arrived = self._arrived(index)
            if arrived >= self.members:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "lockstep %s: turn %d waited %.1f s with %d of %d members; not waiting "
                    "for the rest of this round",
                    self.key,
                    index,
                    self.timeout_s,
                    arrived,
                    self.members,
                )
                self.broken = True
                return
            time.sleep(self.poll_s)

    def leave(self) -> None:
        """This member's episode is over (or never started): later turns stop counting it.
        Calling it again does nothing."""
        if self.left:
            return
        self.left = True
        pipe = self.redis.pipeline()
        pipe.hincrby(f"{self.key}:left", str(self.last_turn), 1)
        pipe.expire(f"{self.key}:left", KEY_TTL_S)
        pipe.execute()
        self.redis.close()
