"""Data offline: the course's data sets (bundled, local folder or synthetic), samplers and loaders, and
Lab-02's input pipelines."""
