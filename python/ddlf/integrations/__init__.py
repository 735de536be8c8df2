"""ddlf beside other systems: Spark as the data supplier and host of workers (:mod:`.spark`)."""
