"""What an entry holds, as data: the key and its factors, the Program, graphs as JSON, the
portable entry record."""
