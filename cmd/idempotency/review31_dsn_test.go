package main

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// An outside review (31): pgx 5.12 reads a URL's user-info as libpq does, up to the
// first '@' before any '/', so a password may hold '#' and '?' unencoded.
// The redaction reads the URL with net/url, which cuts the fragment and
// the query first: for a password that starts with '#' or '?' (or with
// digits and then one of them), the authority that is left parses as a
// host and an empty or numeric port, net/url finds no password, and the
// whole string, password included, is printed as it is: in the help a
// mistyped flag prints ($DATABASE_URL) and in every error. The
// redaction now reads a URL as pgx does.
func TestReview31PasswordWithHashOrQuestionMarkIsNeverPrinted(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ dsn, password string }{
		{"postgres://app:#s3cret@127.0.0.1:1/payments?connect_timeout=1", "#s3cret"},
		{"postgres://app:?s3cret@127.0.0.1:1/payments", "?s3cret"},
		{"postgres://app:12#s3cret@127.0.0.1:1/payments", "12#s3cret"},
		{"postgresql://app:#s3cret@127.0.0.1:1/payments", "#s3cret"},
	} {
		cfg, err := pgconn.ParseConfig(c.dsn)
		require.NoError(t, err, c.dsn)
		require.Equal(t, c.password, cfg.Password, "pgx reads %s's password", c.dsn)
		for _, args := range [][]string{
			{"-databse-url", "x", "migrate"}, // a mistyped flag prints the help, with $DATABASE_URL
			{"migrate"},
			{"-database-url", c.dsn, "inspect", "s", "k"},
		} {
			out, errOut, _ := command(t, []string{"DATABASE_URL=" + c.dsn}, "", args...)
			require.NotContains(t, out+errOut, "s3cret", "%s %v", c.dsn, args)
		}
	}
}

// A URL that pgx reads (a password with '?' past its first character, two
// IPv6 hosts) is refused by the command as not parsing, where pgx would
// connect: the check before pgx was stricter than pgx. It reads a URL as
// pgx does now.
func TestReview31CommandAcceptsEveryURLPgxReads(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://app:s3c?ret@127.0.0.1:1/payments?connect_timeout=1",
		"postgres://app:pw@[::1]:1,[::1]:2/payments?connect_timeout=1",
	} {
		_, err := pgconn.ParseConfig(dsn)
		require.NoError(t, err, "pgx reads %s", dsn)
		_, errOut, _ := command(t, nil, "", "-database-url", dsn, "migrate")
		require.NotContains(t, errOut, "does not parse", dsn)
		require.NotContains(t, errOut, "s3c", dsn)
	}
}
