from hflow.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls,
)

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "WorkerGroupError",
           "create_colocated_worker_cls"]
