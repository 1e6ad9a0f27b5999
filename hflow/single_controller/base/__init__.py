from hflow.single_controller.base.decorator import Dispatch, Execute, register, register_dispatch_mode, update_dispatch_mode
from hflow.single_controller.base.worker import Worker
from hflow.single_controller.base.worker_group import (
    ClassWithInitArgs,
    GroupCall,
    ResourcePool,
    WorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls,
)

__all__ = ["ClassWithInitArgs", "Dispatch", "Execute", "GroupCall", "ResourcePool", "Worker", "WorkerGroup", "WorkerGroupError",
           "create_colocated_worker_cls", "register", "register_dispatch_mode", "update_dispatch_mode"]
