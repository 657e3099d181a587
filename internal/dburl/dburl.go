// Package dburl names the one PostgreSQL every program of this repository
// uses by default: the command, the demo, the example server and consumer,
// the load tool and the tests. It also masks the secrets of a connection
// string, in every form pgx reads, wherever a program prints one.
package dburl

import (
	"errors"
	"net/url"
	"os"
	"strings"
)

// EnvVar names the environment variable holding the database URL.
const EnvVar = "DATABASE_URL"

// Default is used when EnvVar is unset: the local PostgreSQL on its
// standard port, database "test", which scripts/services.sh starts.
const Default = "postgres://postgres:postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns $DATABASE_URL, else Default.
func URL() string {
	if u := os.Getenv(EnvVar); u != "" {
		return u
	}
	return Default
}

// mask replaces a secret.
const mask = "xxxxx"

// Secret reports whether a connection parameter's value is masked:
// password and sslpassword, passfile (where passwords are kept), and any
// parameter whose name says pass, secret or token, so that a parameter of
// a newer libpq or of a pooler is masked before anyone adds it here.
func Secret(param string) bool {
	p := strings.ToLower(param)
	return strings.Contains(p, "pass") || strings.Contains(p, "secret") || strings.Contains(p, "token")
}

// Redacted returns the connection string dsn with every secret masked, for
// messages and flag help: in a URL (postgres:// or postgresql://), the
// user-info's password and the query parameters Secret names; in a
// keyword/value string (host=... password='...'), the values of the
// keywords Secret names, quoted or not. A string that does not parse is
// not shown at all: where its secrets end cannot be told.
func Redacted(dsn string) string {
	r, _, err := parse(dsn)
	if err != nil {
		return "(a connection string that does not parse)"
	}
	return r
}

// Check returns why dsn does not parse, without quoting any of it, or nil.
// A program checks a connection string before it gives it to pgx, whose
// errors about a malformed one quote it.
func Check(dsn string) error {
	_, _, err := parse(dsn)
	return err
}

// Scrub masks the secrets of dsn wherever they appear in s, such as in an
// error message that quotes the connection string: every value Redacted
// masks, as written and as decoded.
func Scrub(s, dsn string) string {
	_, secrets, err := parse(dsn)
	if err != nil {
		return s
	}
	for _, v := range secrets {
		if v != "" {
			s = strings.ReplaceAll(s, v, mask)
		}
	}
	return s
}

// Usage is the help text of a program's database URL flag: where the URL
// comes from, and the one it will use, its secrets masked.
func Usage() string {
	s := "PostgreSQL URL or keyword/value connection string (default: $" + EnvVar + ", else " + Redacted(Default) + ")"
	if u := os.Getenv(EnvVar); u != "" {
		s += "; $" + EnvVar + " is " + Redacted(u)
	}
	return s
}

// parse returns dsn redacted and its secrets (longest first, so that
// Scrub masks a secret before any shorter one inside it).
func parse(dsn string) (redacted string, secrets []string, err error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		redacted, secrets, err = parseURL(dsn)
	} else {
		redacted, secrets, err = parseKeywordValue(dsn)
	}
	// Longest first.
	for i := 1; i < len(secrets); i++ {
		for j := i; j > 0 && len(secrets[j]) > len(secrets[j-1]); j-- {
			secrets[j], secrets[j-1] = secrets[j-1], secrets[j]
		}
	}
	return redacted, secrets, err
}

// parseURL redacts a URL as pgx (5.12 and later) and libpq read one: the
// user-info ends at the first '@' before any '/' (so a password may hold
// '#', '?' and ':' unencoded, and one with an unencoded '@' ends at it, as
// pgx reads it), the query starts at the first '?' after the hosts, and
// there is no fragment. Everything but the password and the secret query
// parameters is kept as written.
func parseURL(dsn string) (string, []string, error) {
	if strings.IndexByte(dsn, 0) >= 0 {
		return "", nil, errors.New("the database URL holds a NUL byte")
	}
	scheme, rest, _ := strings.Cut(dsn, "://")
	var out strings.Builder
	out.WriteString(scheme + "://")
	var secrets []string
	if i := strings.IndexAny(rest, "@/"); i >= 0 && rest[i] == '@' {
		user, password, hasPassword := strings.Cut(rest[:i], ":")
		out.WriteString(user)
		if hasPassword {
			out.WriteString(":" + mask)
			secrets = append(secrets, password)
			if d, err := url.PathUnescape(password); err == nil {
				secrets = append(secrets, d)
			}
		}
		out.WriteByte('@')
		rest = rest[i+1:]
	}
	// The hosts and the path end at the first '?' after them: a '?' of
	// the path is the query's start too, as pgx reads it.
	base, query, hasQuery := strings.Cut(rest, "?")
	if strings.IndexByte(base, '@') >= 0 {
		// An '@' after a '/': pgx reads the user-info as none and the rest
		// as hosts and a database name, but it is a password holding an
		// unencoded '/' far more often than a database named so. Where the
		// password ends cannot be told: not shown, not used.
		return "", nil, errors.New("the database URL has an '@' after a '/': percent-encode the special characters of its user name and password (/ is %2F, @ is %40)")
	}
	out.WriteString(base)
	if hasQuery {
		// Piece by piece, so that the other parameters keep their order and
		// spelling.
		pieces := strings.Split(query, "&")
		for i, piece := range pieces {
			k, v, _ := strings.Cut(piece, "=")
			name, err := url.QueryUnescape(k)
			if err != nil {
				name = k
			}
			if !Secret(name) {
				continue
			}
			secrets = append(secrets, v)
			if d, err := url.QueryUnescape(v); err == nil {
				secrets = append(secrets, d)
			}
			pieces[i] = k + "=" + mask
		}
		out.WriteString("?" + strings.Join(pieces, "&"))
	}
	return out.String(), secrets, nil
}

// parseKeywordValue redacts a keyword/value string as libpq and pgx read
// one: keyword = value, a value either single-quoted or ended by
// whitespace, with backslash escapes in both. The rest of the string is
// kept as written.
func parseKeywordValue(dsn string) (string, []string, error) {
	const space = " \t\n\r\v\f"
	var b strings.Builder
	var secrets []string
	s := dsn
	for {
		trimmed := strings.TrimLeft(s, space)
		b.WriteString(s[:len(s)-len(trimmed)])
		s = trimmed
		if s == "" {
			return b.String(), secrets, nil
		}
		eq := strings.IndexByte(s, '=')
		if eq < 0 {
			return "", nil, errors.New(`the connection string is neither a URL (postgres://...) nor keyword=value pairs: a keyword has no "="`)
		}
		key := strings.TrimRight(s[:eq], space)
		b.WriteString(s[:eq+1])
		s = s[eq+1:]
		trimmed = strings.TrimLeft(s, space)
		b.WriteString(s[:len(s)-len(trimmed)])
		s = trimmed
		var raw, value string
		if strings.HasPrefix(s, "'") {
			end, v, ok := quoted(s[1:])
			if !ok {
				return "", nil, errors.New("the connection string has a quoted value with no closing quote")
			}
			raw, value, s = s[:end+2], v, s[end+2:]
		} else {
			end := 0
			var v strings.Builder
			for end < len(s) && !strings.ContainsRune(space, rune(s[end])) {
				if s[end] == '\\' {
					end++
					if end == len(s) { // a trailing backslash is dropped, as libpq does
						break
					}
				}
				v.WriteByte(s[end])
				end++
			}
			raw, value, s = s[:end], v.String(), s[end:]
		}
		if Secret(key) {
			secrets = append(secrets, raw, value, strings.Trim(raw, "'"))
			b.WriteString(mask)
		} else {
			b.WriteString(raw)
		}
	}
}

// quoted reads a quoted value after its opening quote: the index of the
// closing quote in s, and the value unescaped.
func quoted(s string) (int, string, bool) {
	var v strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\'':
			return i, v.String(), true
		case '\\':
			i++
			if i == len(s) {
				return 0, "", false
			}
		}
		v.WriteByte(s[i])
	}
	return 0, "", false
}
