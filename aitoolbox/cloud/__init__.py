"""Cloud storage (AWS S3, Google Cloud Storage) of aitoolbox 1.x: not supported yet.

The 1.x class names import from their 1.x module paths, so a 1.x script fails with an error that names the local
alternative, not with an ImportError; constructing one raises :class:`NotImplementedError`.
"""
# The cloud_save_mode values of aitoolbox 1.x.
s3_available_options = ["s3", "aws_s3", "aws"]
gcs_available_options = ["gcs", "google_storage", "google storage"]
