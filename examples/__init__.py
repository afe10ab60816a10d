"""The examples: SFTJob manifests, a local trainer config, and assets.py, which puts what
they need into the local cluster (`make example-assets`; the demo imports it)."""
