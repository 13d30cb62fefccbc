"""aitoolbox 1.x's AWS modules: S3 savers and loaders, SES e-mails (``pip install aitoolbox[aws]``)."""
