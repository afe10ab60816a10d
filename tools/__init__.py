"""Developer tools that live in the checkout and never ship in an image: the generator of the
tiny local model and data (`python -m tools.assets`) and the generator of the reference pages
from the CRD and the trainer's config (`python -m tools.reference`, run by `make crds`).
Run them from the repository's root."""
