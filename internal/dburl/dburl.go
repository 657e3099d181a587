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

// parseURL redacts a URL as pgx reads it (net/url, which takes the last
// '@' of the authority as the end of the user-info, so a password with an
// unencoded '@' is masked whole).
func parseURL(dsn string) (string, []string, error) {
	u, err := url.Parse(dsn)
	if err != nil {
		// url's error quotes dsn: not returned.
		return "", nil, errors.New("the database URL does not parse as a URL; percent-encode the special characters of its user name and password (@ is %40, / is %2F, ? is %3F, # is %23)")
	}
	var secrets []string
	if p, ok := u.User.Password(); ok {
		secrets = append(secrets, p, rawPassword(dsn))
		u.User = url.UserPassword(u.User.Username(), mask)
	}
	if u.RawQuery != "" {
		// Piece by piece, so that the other parameters keep their order and
		// spelling.
		pieces := strings.Split(u.RawQuery, "&")
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
		u.RawQuery = strings.Join(pieces, "&")
	}
	return u.String(), secrets, nil
}

// rawPassword is the password of a URL as written, found as net/url finds
// it: the authority ends at the first '/' once the fragment and the query
// are cut, and its user-info at its last '@'.
func rawPassword(dsn string) string {
	_, rest, _ := strings.Cut(dsn, "://")
	rest, _, _ = strings.Cut(rest, "#")
	rest, _, _ = strings.Cut(rest, "?")
	authority, _, _ := strings.Cut(rest, "/")
	i := strings.LastIndexByte(authority, '@')
	if i < 0 {
		return ""
	}
	_, p, _ := strings.Cut(authority[:i], ":")
	return p
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
