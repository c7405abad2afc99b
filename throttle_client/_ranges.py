"""The valid range of every number a limiter accepts: decided once, the same on every store.

Every store counts in whole microseconds since the epoch. SQLite keeps signed 64-bit
integers. The Redis script runs on Lua 5.1, whose only numbers are doubles: they hold
every whole number up to 2**53 exactly, and the script refuses a time, cost, limit or
period it is given that is not a whole number below 2**53. Its arithmetic is sums,
differences, small multiples and floored divisions of such numbers. With the bounds
below, the largest it computes is a time 30 years ahead (``now + 3 * FAR_AHEAD_US``, a
check on a stored expiry: about 2**51.3 µs in 2026, below 2**53 until about 2225), and
a running total stays below ``MAX_TOTAL`` (2**48) plus one cost (at most 2**40), so
every result is exact. The bounds keep every number far inside both stores' ranges,
while leaving any real quota room to spare:

- a limit (so a cost, which never exceeds a limit) is at most ``MAX_LIMIT`` units;
- a period, the minimum interval and a pause are at most ``MAX_SECONDS`` (10 years),
  and ``acquire`` books no slot further ahead than that: a longer ``timeout`` (or
  None) means "wait for any slot", which is at most 10 years away;
- so the furthest time a store works with is a slot 10 years ahead plus a window or
  gap of 10 years after it, plus a little slack: about now + 21 years.

A limiter has at most ``MAX_RATES`` rates. Values outside these ranges are refused
with a ConfigurationError when the limiter (or the Rate) is built, or when the call
that carries them is made, before anything reaches the store.

One number no input bound can hold: a key's running total of admitted units, which
grows until the key goes idle and expires. The stores keep it below ``MAX_TOTAL``
(2**48, six bytes per entry in the Redis log), that is for 256 s of 2**40 units a second,
or 6 million years of 5000 an hour: a booking that would reach it is refused (reset the
key).

What a store holds is checked against these bounds too: a stored running total at or
past ``MAX_TOTAL``, or a stored slot, pause or learned limit's end further ahead than
``FAR_AHEAD_US`` (10 years, and a day of slack for clocks), was never written by a
limiter: the key is damaged (see ``sliding_log``, "partial state").
"""

from __future__ import annotations

MAX_LIMIT = 2**40  # 1,099,511,627,776 units in one window
MIN_PERIOD = 0.000_001  # one microsecond: the unit every store counts in
MAX_SECONDS = 10 * 365.25 * 86400  # 10 years: 315,576,000 s
MAX_US = round(MAX_SECONDS * 1_000_000)
MAX_RATES = 16
MAX_CONCURRENT = 2**20  # calls of one key in flight at once
MAX_TOTAL = 2**48  # a key's running total stays below it (the Lua script's TOTALS)
FAR_AHEAD_US = MAX_US + 86_400_000_000  # (the Lua script's AHEAD)
