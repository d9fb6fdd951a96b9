"""Importing this module imports the wheel's metrics (`wheel()`) and hardens the libraries
they use (`harden()`); that is its only job.

envmanager.osworld_metric_process names it in the forkserver's preload list, so the
forkserver imports the wheel once and every metric process forks with it imported. Nothing
else imports it. Without the wheel it imports nothing more: the metric process then calls
`wheel()` itself and replies with WheelUnavailable's message.
"""

import contextlib

from envmanager.osworld_metric_review import harden
from envmanager.osworld_wheel import WheelUnavailable, wheel

with contextlib.suppress(WheelUnavailable):
    wheel()
    harden()
