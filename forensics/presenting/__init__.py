"""The verdict in words, tables, figures and the HTML report."""
