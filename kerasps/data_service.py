"""`kerasps.data_service`: the public names of `kerasps.runtime.data_service`, where they live."""

from kerasps.runtime.data_service import (
    DataService,
    ServedDataset,
    serve,
)

__all__ = ["DataService", "ServedDataset", "serve"]
