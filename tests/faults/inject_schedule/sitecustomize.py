"""Loaded by a worker started with this folder first on PYTHONPATH (``test_scheduler_death``): the
scheduler's ``schedule`` raises once a request with the id ``EXPLODE`` holds a slot, as a bug in
planning would. Test-only: nothing of the project imports it."""

from services.engine import scheduler

EXPLODE = "explode"
_schedule = scheduler.Scheduler.schedule


def _faulty(self):
    if any(seq.request_id == EXPLODE for seq in self.life.active):
        raise RuntimeError("a fault injected into schedule()")
    return _schedule(self)


scheduler.Scheduler.schedule = _faulty
