"""What the tests share: where things are on disk (:mod:`.paths`), synthetic and real stores
(:mod:`.stores`), tiny random models (:mod:`.models`), the one S3 endpoint (:mod:`.s3`) and the
kill-load driver the fault tests run a short version of (:mod:`.load_extract_kill`)."""
