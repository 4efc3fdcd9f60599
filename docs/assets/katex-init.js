// Renders the maths that pymdownx.arithmatex wrapped in `arithmatex` spans, with
// the KaTeX copy served from this site. Runs on every page load and every instant
// navigation (Material's document$ observable).
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: true,
  });
});
