package idempotency

import "strings"

// txControl returns the first statement of sql (one statement, or several
// separated by semicolons, as the simple protocol allows) that would end or
// reshape the call's transaction, named for an error message; "" when
// there is none. Refused: BEGIN, START TRANSACTION, COMMIT, END, ABORT,
// ROLLBACK (but not ROLLBACK TO SAVEPOINT), PREPARE TRANSACTION, SET
// TRANSACTION, SET SESSION CHARACTERISTICS, SET of the settings behind
// those two and of standard_conforming_strings (which changes how SQL
// reads), and DEALLOCATE (which would pull the connection's prepared
// statements from under pgx); a setting written U&"..." where one of those
// names could hide. Savepoints are the handler's to use, under any name:
// the engine's own has a name no handler knows (see claimSavepoint).
//
// It reads SQL as PostgreSQL's lexer does, both with
// standard_conforming_strings on (the default since 9.1) and off, and
// refuses what either reading finds: quoted strings and identifiers,
// E'...' strings, dollar quoting and nested comments hide what they
// contain, and a CREATE FUNCTION or PROCEDURE's BEGIN ATOMIC body is one
// statement, as psql reads it. DO blocks and procedures need no check:
// PostgreSQL refuses to commit inside them while a transaction block is
// open.
//
// preparedName is set when sql may be nothing but the name of a statement
// prepared on the connection (pgx runs a prepared statement given its
// name), whose own SQL the caller must check.
func txControl(sql string) (what, preparedName string) {
	if what = scanTxControl(sql, false); what == "" {
		what = scanTxControl(sql, true)
	}
	if what == "" && maybeStatementName(sql) {
		preparedName = sql
	}
	return what, preparedName
}

// scanTxControl is txControl for one reading of backslashes in quoted
// strings.
func scanTxControl(sql string, backslashQuotes bool) string {
	l := sqlLexer{s: sql, backslashQuotes: backslashQuotes}
	for {
		start := l.i
		first := l.word()
		switch first {
		case "begin", "commit", "end", "abort", "deallocate":
			return strings.ToUpper(first)
		case "start":
			if l.word() == "transaction" {
				return "START TRANSACTION"
			}
		case "rollback":
			switch l.word() {
			case "to": // ROLLBACK TO SAVEPOINT, within the transaction
			case "prepared":
				return "ROLLBACK PREPARED"
			default:
				return "ROLLBACK"
			}
		case "prepare":
			if l.word() == "transaction" {
				return "PREPARE TRANSACTION"
			}
		case "set":
			if what := l.setTarget(); what != "" {
				return "SET " + what
			}
		}
		l.i = start
		if !l.nextStatement() {
			return ""
		}
	}
}

// unicodeIdent stands for an identifier written U&"...", whose escapes
// could spell any name.
const unicodeIdent = "U&\"...\""

// maybeStatementName reports whether sql could be the name of a prepared
// statement rather than SQL: no spaces, and not starting with a word that
// SQL statements start with. (A name can be any string; one with spaces is
// missed, which only costs the clearer error: see callTx.)
func maybeStatementName(sql string) bool {
	name := strings.TrimSpace(sql)
	if name == "" || strings.ContainsAny(name, " \t\n\r\f\v;") {
		return false
	}
	l := sqlLexer{s: name}
	return !sqlCommands[l.word()]
}

// sqlCommands are the words SQL statements start with.
var sqlCommands = map[string]bool{}

func init() {
	for _, w := range strings.Fields(`abort alter analyze begin call checkpoint close cluster comment commit copy create
deallocate declare delete discard do drop end execute explain fetch grant import insert listen load lock merge move
notify prepare reassign refresh reindex release reset revoke rollback savepoint security select set show start table
truncate unlisten update vacuum values with`) {
		sqlCommands[w] = true
	}
}

// sqlLexer reads just enough of SQL to find statements' leading words.
type sqlLexer struct {
	s string
	i int
	// backslashQuotes reads a backslash in a plain quoted string as an
	// escape, as with standard_conforming_strings off.
	backslashQuotes bool
}

// skipSpace skips whitespace and comments.
func (l *sqlLexer) skipSpace() {
	for l.i < len(l.s) {
		switch c := l.s[l.i]; {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			l.i++
		case c == '-' && strings.HasPrefix(l.s[l.i:], "--"):
			// PostgreSQL ends a comment at a carriage return too.
			if n := strings.IndexAny(l.s[l.i:], "\n\r"); n >= 0 {
				l.i += n + 1
			} else {
				l.i = len(l.s)
			}
		case c == '/' && strings.HasPrefix(l.s[l.i:], "/*"):
			l.skipBlockComment()
		default:
			return
		}
	}
}

// skipBlockComment skips a /* */ comment, which may nest.
func (l *sqlLexer) skipBlockComment() {
	depth := 0
	for l.i < len(l.s) {
		switch {
		case strings.HasPrefix(l.s[l.i:], "/*"):
			depth++
			l.i += 2
		case strings.HasPrefix(l.s[l.i:], "*/"):
			depth--
			l.i += 2
			if depth == 0 {
				return
			}
		default:
			l.i++
		}
	}
}

// word reads the next keyword or bare identifier, lower-cased; "" when the
// next token is something else.
func (l *sqlLexer) word() string {
	l.skipSpace()
	start := l.i
	for l.i < len(l.s) && isIdentByte(l.s[l.i], l.i > start) {
		l.i++
	}
	return strings.ToLower(l.s[start:l.i])
}

// peekWord returns the next word without moving past it.
func (l *sqlLexer) peekWord() string {
	save := l.i
	w := l.word()
	l.i = save
	return w
}

// ident reads an identifier, bare (lower-cased, as PostgreSQL folds it) or
// double-quoted (as written); unicodeIdent for one written U&"...".
func (l *sqlLexer) ident() string {
	l.skipSpace()
	if rest := l.s[l.i:]; len(rest) >= 3 && (rest[0] == 'u' || rest[0] == 'U') && rest[1] == '&' && rest[2] == '"' {
		l.i += 2
		l.skipQuoted('"')
		return unicodeIdent
	}
	if l.i < len(l.s) && l.s[l.i] == '"' {
		start := l.i
		l.skipQuoted('"')
		quoted := l.s[start+1 : max(l.i-1, start+1)]
		return strings.ReplaceAll(quoted, `""`, `"`)
	}
	return l.word()
}

// setTarget reads what a SET statement sets and names it when it is the
// transaction's characteristics: SET [SESSION | LOCAL] TRANSACTION ..., SET
// SESSION CHARACTERISTICS ..., or SET [SESSION | LOCAL] of one of the
// settings behind them (transactionSettings).
func (l *sqlLexer) setTarget() string {
	name := l.ident()
	if name == "session" || name == "local" {
		next := l.ident()
		if name == "session" && next == "characteristics" {
			return "SESSION CHARACTERISTICS"
		}
		name = next
	}
	switch {
	case name == "transaction":
		return "TRANSACTION"
	case transactionSettings[name], name == "standard_conforming_strings", name == unicodeIdent:
		return name
	}
	return ""
}

// transactionSettings are the settings SET TRANSACTION and SET SESSION
// CHARACTERISTICS change: the current transaction's isolation, read-only
// and deferrable modes, and the defaults of later ones (which on a pooled
// connection would reach other calls).
var transactionSettings = map[string]bool{
	"transaction_isolation": true, "transaction_read_only": true, "transaction_deferrable": true,
	"default_transaction_isolation": true, "default_transaction_read_only": true, "default_transaction_deferrable": true,
}

// nextStatement moves from the start of a statement past its end, its
// first semicolon outside parentheses and outside the BEGIN ... END body of
// a CREATE [OR REPLACE] FUNCTION or PROCEDURE (counting CASE ... END in
// it, as psql does); false when there is none.
func (l *sqlLexer) nextStatement() bool {
	var leading []string // the statement's first words, for CREATE ... FUNCTION
	parens, begins := 0, 0
	for l.i < len(l.s) {
		c := l.s[l.i]
		switch {
		case c == ';' && parens == 0 && begins == 0:
			l.i++
			return true
		case c == '(':
			parens++
			l.i++
		case c == ')':
			parens = max(parens-1, 0)
			l.i++
		case c == '\'':
			if l.backslashQuotes {
				l.skipEscapeString()
			} else {
				l.skipQuoted('\'')
			}
		case c == '"':
			l.skipQuoted('"')
		case (c == 'e' || c == 'E') && l.i+1 < len(l.s) && l.s[l.i+1] == '\'':
			l.i++
			l.skipEscapeString()
		case c == '$':
			l.skipDollar()
		case c == '-' && strings.HasPrefix(l.s[l.i:], "--"), c == '/' && strings.HasPrefix(l.s[l.i:], "/*"):
			l.skipSpace()
		case isIdentByte(c, false):
			// A whole word, so that the E of a word like "type" never
			// starts an escape string.
			start := l.i
			for l.i < len(l.s) && isIdentByte(l.s[l.i], true) {
				l.i++
			}
			word := strings.ToLower(l.s[start:l.i])
			if len(leading) < 4 {
				leading = append(leading, word)
			}
			if parens == 0 && definesRoutine(leading) {
				switch {
				case word == "begin" && l.peekWord() == "atomic":
					begins++
				case word == "case" && begins > 0:
					begins++
				case word == "end" && begins > 0:
					begins--
				}
			}
		default:
			l.i++
		}
	}
	return false
}

// definesRoutine reports whether a statement's first words are CREATE [OR
// REPLACE] FUNCTION or PROCEDURE, whose body may be BEGIN ATOMIC ... END.
func definesRoutine(w []string) bool {
	routine := func(s string) bool { return s == "function" || s == "procedure" }
	return len(w) >= 2 && w[0] == "create" &&
		(routine(w[1]) || (len(w) >= 4 && w[1] == "or" && w[2] == "replace" && routine(w[3])))
}

// skipQuoted skips a string or identifier quoted with q, in which a doubled
// q stands for itself.
func (l *sqlLexer) skipQuoted(q byte) {
	l.i++ // the opening quote
	for l.i < len(l.s) {
		if l.s[l.i] == q {
			if l.i+1 < len(l.s) && l.s[l.i+1] == q {
				l.i += 2
				continue
			}
			l.i++
			return
		}
		l.i++
	}
}

// skipEscapeString skips an E'...' string, where a backslash escapes the next
// character.
func (l *sqlLexer) skipEscapeString() {
	l.i++ // the opening quote
	for l.i < len(l.s) {
		switch l.s[l.i] {
		case '\\':
			l.i += 2
			continue
		case '\'':
			if l.i+1 < len(l.s) && l.s[l.i+1] == '\'' {
				l.i += 2
				continue
			}
			l.i++
			return
		}
		l.i++
	}
}

// skipDollar skips a dollar-quoted string ($$...$$ or $tag$...$tag$), or a
// lone $ such as a parameter's ($1).
func (l *sqlLexer) skipDollar() {
	end := l.i + 1
	for end < len(l.s) && l.s[end] != '$' && isIdentByte(l.s[end], end > l.i+1) {
		end++
	}
	if end >= len(l.s) || l.s[end] != '$' {
		l.i++ // a parameter, or a $ inside a word
		return
	}
	tag := l.s[l.i : end+1]
	if n := strings.Index(l.s[end+1:], tag); n >= 0 {
		l.i = end + 1 + n + len(tag)
	} else {
		l.i = len(l.s)
	}
}

// isIdentByte reports whether c can be part of a bare identifier; digits
// and $ only after its first byte. Bytes of multibyte characters count as
// letters, as PostgreSQL's lexer takes them.
func isIdentByte(c byte, notFirst bool) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '_', c >= 0x80:
		return true
	case c >= '0' && c <= '9', c == '$':
		return notFirst
	}
	return false
}
