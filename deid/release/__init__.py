"""Release and provenance: staging, signing, verification, linkage, lineage, dataset card and catalogue."""
