#!/usr/bin/env python3
"""Checks the links of the facade's rendered API (target/doc/cqd, made by
`cargo doc -p cqd --no-deps`): every link of cqd's own documentation must
reach a page that exists. Left out: the "Blanket Implementations" sections
(third-party traits implemented for every type, whose docs link into crates
that --no-deps does not render), rustdoc's own "all items" sidebar link
of an inlined module, and the "Source" links of inlined items (they point at
the other crates' source pages, which --no-deps does not render either)."""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/doc/cqd"
if not os.path.isdir(root):
    sys.exit(f"{root}: not rendered (run cargo doc -p cqd --no-deps first)")
broken, pages, links = [], 0, 0
for d, _, files in os.walk(root):
    for f in files:
        if not f.endswith(".html"):
            continue
        pages += 1
        path = os.path.join(d, f)
        text = open(path, encoding="utf-8", errors="replace").read()
        text = text.split('id="blanket-implementations"')[0]
        for href in re.findall(r'href="([^"]+)"', text):
            if href.startswith(("http://", "https://", "#", "mailto:")) or "${" in href:
                continue
            target = href.split("#")[0]
            if not target or os.path.basename(target) == "all.html":
                continue
            if "/src/" in "/" + os.path.relpath(os.path.normpath(os.path.join(d, target)), os.path.dirname(root)).replace(os.sep, "/"):
                continue
            links += 1
            if not target.endswith((".html", ".css", ".js", ".svg", ".png", "/")):
                broken.append((path, href, "not a page (an unresolved intra-doc link?)"))
            elif not os.path.exists(os.path.normpath(os.path.join(d, target))):
                broken.append((path, href, "no such page"))
for path, href, why in broken[:40]:
    print(f"{path}: {href}: {why}")
print(f"doc links: {pages} pages, {links} links, {len(broken)} broken")
sys.exit(1 if broken else 0)
