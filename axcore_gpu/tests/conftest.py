"""Makes the axcore-gpu package importable without installing it (CI installs only axcore and plugins/*/)."""

import pathlib
import sys

GPU_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]

if str(GPU_PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(GPU_PACKAGE_ROOT))
