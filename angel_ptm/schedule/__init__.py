"""The unified scheduler: record one step's page accesses, plan every move ahead of need, execute the plan on
separate queues while compute runs (ARCHITECTURE.md, "The step")."""

from angel_ptm.schedule.communicator import Communicator, PendingCollective
from angel_ptm.schedule.executor import Executor, Scheduler, StepStats
from angel_ptm.schedule.planner import Op, Plan, plan_step
from angel_ptm.schedule.trace import Access, StepRecorder, StepTrace

__all__ = ["Access", "Communicator", "Executor", "PendingCollective", "Op", "Plan", "Scheduler", "StepRecorder", "StepStats",
           "StepTrace", "plan_step"]
