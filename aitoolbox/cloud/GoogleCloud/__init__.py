"""aitoolbox 1.x's Google Cloud modules: Google Cloud Storage savers and loaders (``pip install aitoolbox[gcs]``)."""
