"""pluggy markers of the `axcore` project: `hookspec` for specs, `hookimpl` for implementations.

The lowest file of the plugin machinery, so that built-in plugins and hookspecs can
both import the markers without importing each other.
"""

import pluggy

PROJECT_NAME = "axcore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
