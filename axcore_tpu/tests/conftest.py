"""Makes the axcore-tpu package importable without installing it (CI installs only axcore and plugins/*/)."""

import pathlib
import sys

TPU_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]

if str(TPU_PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(TPU_PACKAGE_ROOT))
