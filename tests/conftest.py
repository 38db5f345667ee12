"""Suite-wide settings: hypothesis draws the same examples on every run (CI must not be flaky);
set HYPOTHESIS_PROFILE=explore locally to draw fresh examples."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
