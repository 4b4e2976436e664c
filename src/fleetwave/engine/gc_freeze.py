"""The conductor's use of ``gc.freeze``: :class:`GcFreezeMixin`.

A loaded strategy is moved out of the collector's sight (``EngineConfig.gc_freeze``),
so that full collections do not rescan every loaded step; it is given back when a
strategy ends and when the conductor stops. The freeze is the process's: every
conductor of the process that froze is told when one lifts it.
"""

from __future__ import annotations

import gc
import weakref

from fleetwave.engine.config import EngineConfig
from fleetwave.engine.run import StrategyRun

#: the conductors of this process whose gc.freeze is in force: a freeze is the
#: process's, so one conductor lifting it lifts it for all of them
_FREEZERS: weakref.WeakSet[GcFreezeMixin] = weakref.WeakSet()


class GcFreezeMixin:
    """The conductor's gc.freeze: a mixin of :class:`Conductor`, which sets what is
    declared here."""

    # the conductor's, used here
    config: EngineConfig
    runs: dict[int, StrategyRun]
    _frozen: bool
    _refreeze_after: int | None

    def _freeze(self) -> None:
        """Move what is loaded now out of the collector's sight (``gc_freeze``)."""
        if self.config.gc_freeze:
            gc.freeze()
            self._frozen, self._refreeze_after = True, None
            _FREEZERS.add(self)

    def _thaw(self, *, refreeze: bool) -> None:
        """A strategy ended (or the conductor stops): give what the freeze holds back to
        the collector, which frees what of it is garbage now (an ended strategy's steps,
        a finished run's reference cycles: a freeze never frees them). ``refreeze``: other
        strategies go on, so freeze again once a full collection has run (until then,
        full collections rescan their steps). The freeze is the process's: the other
        conductors that froze (a simulator's, tests') freeze again then too."""
        if not self._frozen:
            if not refreeze:
                self._refreeze_after = None
            return
        gc.unfreeze()
        collections = gc.get_stats()[2]["collections"]
        self._frozen = False
        self._refreeze_after = collections if refreeze else None
        _FREEZERS.discard(self)
        for other in list(_FREEZERS):
            other._frozen, other._refreeze_after = False, collections
            _FREEZERS.discard(other)

    def _refreeze_if_collected(self) -> None:
        if (
            self._refreeze_after is not None
            and gc.get_stats()[2]["collections"] > self._refreeze_after
        ):
            self._refreeze_after = None
            if self.runs:
                self._freeze()
