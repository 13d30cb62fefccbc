"""The cloud tests' servers and buckets (moto's S3 server, the GCS emulator), for the bucket part of the corpus."""
from tests.cloud.conftest import bucket, gcs_env, gcs_server, s3_env, s3_server, service  # noqa: F401
