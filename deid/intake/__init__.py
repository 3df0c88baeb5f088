"""Input: reading a drop, ingesting it to staging, decoding images, the London importer and synthetic drops."""
