//! Shell words: a `bash -c` / `sh -c` string split the way the shell splits it, with the byte
//! span of every word in the string, so that one value can be replaced and the rest of the
//! string kept byte for byte.
//!
//! Only what a launch line uses is understood: blanks, single and double quotes, backslash
//! escapes, line continuations, comments, and the operators that separate commands (`&&`,
//! `||`, `;`, `|`, `&`, newline). A word that holds an expansion (`$X`, `$(…)`, a backquote)
//! is marked: its text is not what the program will see, so it is never trusted or rewritten.

use std::ops::Range;

/// One word of a shell string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Word {
    /// The word after quote removal: what the program receives (unless `expands`).
    pub text: String,
    /// Its bytes in the string, quotes included.
    pub span: Range<usize>,
    /// It holds a `$` or backquote expansion outside single quotes: its value is not known.
    pub expands: bool,
}

/// A token: a word, or an operator that ends a simple command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// A word.
    Word(Word),
    /// `&&`, `||`, `;`, `|`, `&` or a newline: the command before it has ended.
    Separator(Range<usize>),
}

/// Why a string could not be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// A quote that is never closed.
    #[error("a {quote} quote opened at byte {at} is never closed")]
    UnclosedQuote {
        /// `single` or `double`.
        quote: &'static str,
        /// Where it opened.
        at: usize,
    },
    /// A backslash at the very end.
    #[error("the string ends with a lone backslash")]
    TrailingBackslash,
}

/// Splits `s` into words and separators, as `sh` does before running it.
pub fn split(s: &str) -> Result<Vec<Token>, SplitError> {
    let bytes = s.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    // The word being built: its start, text, and whether it expands.
    let mut current: Option<(usize, String, bool)> = None;
    let finish =
        |current: &mut Option<(usize, String, bool)>, end: usize, tokens: &mut Vec<Token>| {
            if let Some((start, text, expands)) = current.take() {
                tokens.push(Token::Word(Word {
                    text,
                    span: start..end,
                    expands,
                }));
            }
        };
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b' ' | b'\t' => {
                finish(&mut current, i, &mut tokens);
                i += 1;
            }
            b'\n' | b';' => {
                finish(&mut current, i, &mut tokens);
                tokens.push(Token::Separator(i..i + 1));
                i += 1;
            }
            // `2>&1`, `&>`: a redirection, not a separator.
            b'&' if i > 0 && matches!(bytes[i - 1], b'>' | b'<') && current.is_some() => {
                if let Some(word) = current.as_mut() {
                    word.1.push('&');
                }
                i += 1;
            }
            b'&' | b'|' => {
                finish(&mut current, i, &mut tokens);
                let len = if bytes.get(i + 1) == Some(&c) { 2 } else { 1 };
                tokens.push(Token::Separator(i..i + len));
                i += len;
            }
            b'#' if current.is_none() => {
                // A comment runs to the end of the line.
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'\\' => {
                match next_char(s, i + 1) {
                    None => return Err(SplitError::TrailingBackslash),
                    Some('\n') => {
                        // A line continuation: nothing, not even a word break.
                        i += 2;
                    }
                    Some(ch) => {
                        current
                            .get_or_insert_with(|| (i, String::new(), false))
                            .1
                            .push(ch);
                        i += 1 + ch.len_utf8();
                    }
                }
            }
            b'\'' => {
                let word = current.get_or_insert_with(|| (i, String::new(), false));
                let Some(close) = s[i + 1..].find('\'') else {
                    return Err(SplitError::UnclosedQuote {
                        quote: "single",
                        at: i,
                    });
                };
                word.1.push_str(&s[i + 1..i + 1 + close]);
                i += close + 2;
            }
            b'"' => {
                let open = i;
                let word = current.get_or_insert_with(|| (i, String::new(), false));
                i += 1;
                loop {
                    let Some(ch) = next_char(s, i) else {
                        return Err(SplitError::UnclosedQuote {
                            quote: "double",
                            at: open,
                        });
                    };
                    match ch {
                        '"' => {
                            i += 1;
                            break;
                        }
                        '\\' => match next_char(s, i + 1) {
                            Some(e @ ('$' | '`' | '"' | '\\')) => {
                                word.1.push(e);
                                i += 2;
                            }
                            Some('\n') => i += 2,
                            _ => {
                                word.1.push('\\');
                                i += 1;
                            }
                        },
                        '$' | '`' => {
                            word.2 = true;
                            word.1.push(ch);
                            i += 1;
                        }
                        _ => {
                            word.1.push(ch);
                            i += ch.len_utf8();
                        }
                    }
                }
            }
            _ => {
                let ch = next_char(s, i).unwrap_or('\u{FFFD}');
                let word = current.get_or_insert_with(|| (i, String::new(), false));
                if matches!(
                    ch,
                    '$' | '`' | '(' | ')' | '<' | '>' | '*' | '?' | '[' | '{' | '~'
                ) {
                    // Expansions, redirections, globs: the program sees something else.
                    word.2 = true;
                }
                word.1.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    finish(&mut current, bytes.len(), &mut tokens);
    Ok(tokens)
}

fn next_char(s: &str, at: usize) -> Option<char> {
    s.get(at..).and_then(|rest| rest.chars().next())
}

/// The simple commands of a split string: the words between separators, in order.
pub fn commands(tokens: &[Token]) -> Vec<Vec<Word>> {
    let mut out = vec![Vec::new()];
    for token in tokens {
        match token {
            Token::Word(w) => out.last_mut().map(|c| c.push(w.clone())).unwrap_or(()),
            Token::Separator(_) => out.push(Vec::new()),
        }
    }
    out.retain(|c| !c.is_empty());
    out
}

/// Resolves `$NAME`, `${NAME}` and `${NAME:-default}` in the words of `commands`, in order, as
/// the shell would: from `env` (the container's literal variables) and from the assignments
/// of earlier commands (`NAME=value`, `export NAME=value`). A word whose every expansion
/// resolves gets its value and is no longer marked; a command substitution, a glob, a
/// variable nobody sets, or one set from an unresolved word keeps it marked (unknown).
/// Assignments inside a command that runs something (`NAME=value cmd`) are that command's
/// own and are not carried on.
pub fn resolve(commands: &mut [Vec<Word>], env: &std::collections::BTreeMap<String, String>) {
    let mut vars: std::collections::BTreeMap<String, Option<String>> = env
        .iter()
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .collect();
    for command in commands.iter_mut() {
        for word in command.iter_mut().filter(|w| w.expands) {
            if let Some(text) = substitute(&word.text, &vars) {
                word.text = text;
                word.expands = false;
            }
        }
        let words: Vec<&Word> = match command.first().map(|w| w.text.as_str()) {
            Some("export" | "declare" | "readonly" | "local") => command[1..].iter().collect(),
            _ => command.iter().collect(),
        };
        let assignments: Vec<(String, Option<String>)> = words
            .iter()
            .map_while(|w| {
                let (name, value) = w.text.split_once('=')?;
                let valid = !name.is_empty()
                    && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    && !name.as_bytes()[0].is_ascii_digit();
                valid.then(|| (name.to_string(), (!w.expands).then(|| value.to_string())))
            })
            .collect();
        // Only a command made of assignments alone sets the shell's variables.
        if assignments.len() == words.len() {
            vars.extend(assignments);
        }
    }
}

/// `text` with its `$NAME` / `${NAME}` / `${NAME:-default}` references replaced from `vars`,
/// or `None` when any reference is unknown or the text expands otherwise (`$(…)`, a backquote,
/// a glob or redirection character outside a reference).
fn substitute(
    text: &str,
    vars: &std::collections::BTreeMap<String, Option<String>>,
) -> Option<String> {
    let lookup = |name: &str| vars.get(name).cloned().flatten();
    let name_len = |s: &str| {
        s.bytes()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
            .count()
    };
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        let plain = &rest[..at];
        if plain.contains(['`', '(', ')', '<', '>', '*', '?', '[', '{', '}', '~']) {
            return None;
        }
        out.push_str(plain);
        let after = &rest[at + 1..];
        if let Some(inner) = after.strip_prefix('{') {
            let close = inner.find('}')?;
            let body = &inner[..close];
            let n = name_len(body);
            let (name, tail) = body.split_at(n);
            let value = match tail {
                "" => lookup(name)?,
                t => {
                    let default = t.strip_prefix(":-").or_else(|| t.strip_prefix('-'))?;
                    if default.contains(['$', '`']) {
                        return None;
                    }
                    lookup(name)
                        .filter(|v| !v.is_empty() || t.starts_with('-'))
                        .unwrap_or_else(|| default.to_string())
                }
            };
            if n == 0 {
                return None;
            }
            out.push_str(&value);
            rest = &inner[close + 1..];
        } else {
            let n = name_len(after);
            if n == 0 || after.as_bytes()[0].is_ascii_digit() {
                return None;
            }
            out.push_str(&lookup(&after[..n])?);
            rest = &after[n..];
        }
    }
    if rest.contains(['`', '(', ')', '<', '>', '*', '?', '[', '{', '}', '~']) {
        return None;
    }
    out.push_str(rest);
    Some(out)
}

/// `value` written as one shell word: bare when it is plain, single-quoted otherwise.
pub fn quote(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// `s` with each span replaced by its text (spans must not overlap; order does not matter).
pub fn replace_spans(s: &str, edits: &[(Range<usize>, String)]) -> String {
    let mut edits: Vec<&(Range<usize>, String)> = edits.iter().collect();
    edits.sort_by_key(|(r, _)| (r.start, r.end));
    let mut out = String::with_capacity(s.len() + 32);
    let mut at = 0;
    for (range, text) in edits {
        let start = range.start.clamp(at, s.len());
        out.push_str(s.get(at..start).unwrap_or(""));
        out.push_str(text);
        at = range.end.clamp(start, s.len());
    }
    out.push_str(s.get(at..).unwrap_or(""));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        split(s)
            .expect("test input")
            .into_iter()
            .filter_map(|t| match t {
                Token::Word(w) => Some(w.text),
                Token::Separator(_) => None,
            })
            .collect()
    }

    #[test]
    fn splits_quotes_escapes_and_continuations() {
        assert_eq!(
            words("a 'b c' \"d \\\"e\\\"\" f\\ g h\\\n i"),
            ["a", "b c", "d \"e\"", "f g", "h", "i"]
        );
        assert_eq!(words("x'y'\"z\""), ["xyz"]);
        assert_eq!(words("a # comment\nb"), ["a", "b"]);
    }

    #[test]
    fn spans_cover_the_quoted_word() {
        let s = "torchrun  --bs='8' x";
        let tokens = split(s).expect("test input");
        let Token::Word(w) = &tokens[1] else { panic!() };
        assert_eq!(&s[w.span.clone()], "--bs='8'");
        assert_eq!(w.text, "--bs=8");
    }

    #[test]
    fn separators_end_commands() {
        let tokens =
            split("pip install x && cd /a; python t.py 2>&1 | tee log &").expect("test input");
        let cmds: Vec<Vec<String>> = commands(&tokens)
            .into_iter()
            .map(|c| c.into_iter().map(|w| w.text).collect())
            .collect();
        assert_eq!(
            cmds,
            [
                vec!["pip", "install", "x"],
                vec!["cd", "/a"],
                vec!["python", "t.py", "2>&1"],
                vec!["tee", "log"]
            ]
        );
    }

    #[test]
    fn expansions_are_marked() {
        let tokens = split("a $B \"c$D\" 'e$F'").expect("test input");
        let marks: Vec<bool> = tokens
            .iter()
            .map(|t| matches!(t, Token::Word(w) if w.expands))
            .collect();
        assert_eq!(marks, [false, true, true, false]);
    }

    fn resolved(script: &str, env: &[(&str, &str)]) -> Vec<(String, bool)> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut cmds = commands(&split(script).expect("test input"));
        resolve(&mut cmds, &env);
        cmds.pop()
            .expect("a command")
            .into_iter()
            .map(|w| (w.text, w.expands))
            .collect()
    }

    #[test]
    fn variables_set_earlier_or_in_the_env_resolve() {
        let got = resolved(
            "MODEL=\"Qwen/Qwen-7B\" # comment\nexport BS=4\nLR=1e-4 python x.py\n\
             python t.py --m $MODEL --bs ${BS} --n ${NNODES:-1} --lr $LR --d $DATA --g $(nproc)",
            &[("DATA", "/data")],
        );
        let want = [
            ("python", false),
            ("t.py", false),
            ("--m", false),
            ("Qwen/Qwen-7B", false),
            ("--bs", false),
            ("4", false),
            ("--n", false),
            ("1", false),
            ("--lr", false),
            // Set only for the command it prefixed.
            ("$LR", true),
            ("--d", false),
            ("/data", false),
            ("--g", false),
            ("$(nproc)", true),
        ];
        let want: Vec<(String, bool)> = want.iter().map(|(t, e)| (t.to_string(), *e)).collect();
        assert_eq!(got, want);
        // A variable set from something unknown stays unknown.
        let got = resolved("N=$(nproc)\npython t.py --n $N", &[]);
        assert_eq!(got[3], ("$N".to_string(), true));
    }

    #[test]
    fn unclosed_quotes_are_errors() {
        assert!(matches!(
            split("a 'b"),
            Err(SplitError::UnclosedQuote { .. })
        ));
        assert!(matches!(
            split("a \"b"),
            Err(SplitError::UnclosedQuote { .. })
        ));
        assert_eq!(split("a \\"), Err(SplitError::TrailingBackslash));
    }

    #[test]
    fn quote_round_trips_through_split() {
        for v in ["8", "a b", "it's", "", "--x=1", "$HOME"] {
            assert_eq!(words(&quote(v)), [v]);
        }
    }

    #[test]
    fn replace_keeps_the_rest_byte_for_byte() {
        let s = "pip install -q x &&  torchrun t.py --bs 8   --lr 1e-4";
        let at = s.find("8 ").expect("test input");
        assert_eq!(
            replace_spans(s, &[(at..at + 1, "2".into())]),
            "pip install -q x &&  torchrun t.py --bs 2   --lr 1e-4"
        );
    }
}
