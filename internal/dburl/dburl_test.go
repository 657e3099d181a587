package dburl

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// Every form of connection string pgx reads, with the secrets it holds:
// Redacted shows none of them and keeps the rest, Scrub masks them in a
// message that quotes the string, and pgx reads the same password.
func TestEveryFormIsRedacted(t *testing.T) {
	for _, c := range []struct {
		name, dsn string
		// password is what pgx reads as the password, "" for none.
		password string
		secrets  []string
		want     string
	}{
		{name: "URL user-info", dsn: "postgres://app:s3cret-pw@db.internal:5432/payments?sslmode=require",
			password: "s3cret-pw", secrets: []string{"s3cret-pw"},
			want: "postgres://app:xxxxx@db.internal:5432/payments?sslmode=require"},
		{name: "URL user-info percent-encoded", dsn: "postgresql://app:p%40ss%2Fw0rd@db/payments",
			password: "p@ss/w0rd", secrets: []string{"p@ss/w0rd", "p%40ss%2Fw0rd"},
			want: "postgresql://app:xxxxx@db/payments"},
		{name: "URL with several hosts", dsn: "postgres://app:multi-pw@h1:5432,h2:5433/payments?target_session_attrs=read-write",
			password: "multi-pw", secrets: []string{"multi-pw"},
			want: "postgres://app:xxxxx@h1:5432,h2:5433/payments?target_session_attrs=read-write"},
		{name: "URL password parameter", dsn: "postgres://app@db/payments?sslmode=disable&password=q-s3cret&application_name=x",
			password: "q-s3cret", secrets: []string{"q-s3cret"},
			want: "postgres://app@db/payments?sslmode=disable&password=xxxxx&application_name=x"},
		{name: "URL password parameter encoded", dsn: "postgres://app@db/payments?pass%77ord=enc%20s3cret",
			password: "enc s3cret", secrets: []string{"enc s3cret", "enc%20s3cret"},
			want: "postgres://app@db/payments?pass%77ord=xxxxx"},
		{name: "URL sslpassword and passfile", dsn: "postgres://app@db/payments?sslpassword=key-s3cret&passfile=/home/app/.pgpass-s3cret",
			secrets: []string{"key-s3cret", "/home/app/.pgpass-s3cret"},
			want:    "postgres://app@db/payments?sslpassword=xxxxx&passfile=xxxxx"},
		{name: "URL socket directory", dsn: "postgres:///payments?host=/var/run/postgresql&password=sock-s3cret",
			password: "sock-s3cret", secrets: []string{"sock-s3cret"},
			want: "postgres:///payments?host=/var/run/postgresql&password=xxxxx"},
		{name: "keyword/value", dsn: "host=db user=app password=kv-s3cret dbname=payments",
			password: "kv-s3cret", secrets: []string{"kv-s3cret"},
			want: "host=db user=app password=xxxxx dbname=payments"},
		{name: "keyword/value quoted", dsn: `host=db password = 'two words \'s3cret\'' sslpassword='pfx-phrase s3cret' dbname=payments`,
			password: `two words 's3cret'`, secrets: []string{`two words 's3cret'`, `two words \'s3cret\'`, "pfx-phrase s3cret"},
			want: "host=db password = xxxxx sslpassword=xxxxx dbname=payments"},
		{name: "keyword/value escaped", dsn: `password=back\ slash\\s3cret host=db`,
			password: `back slash\s3cret`, secrets: []string{`back slash\s3cret`, `back\ slash\\s3cret`},
			want: "password=xxxxx host=db"},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.NoError(t, Check(c.dsn))
			if c.password != "" {
				cfg, err := pgconn.ParseConfig(c.dsn)
				require.NoError(t, err)
				require.Equal(t, c.password, cfg.Password, "the secret of the case is pgx's password")
			}
			red := Redacted(c.dsn)
			require.Equal(t, c.want, red)
			usage := usageWith(t, c.dsn)
			msg := Scrub("failed to connect to `"+c.dsn+"` (password "+c.password+")", c.dsn)
			for _, s := range c.secrets {
				for _, part := range strings.Fields(s) {
					require.NotContains(t, red, part)
					require.NotContains(t, usage, part)
					require.NotContains(t, msg, part)
				}
			}
			require.Contains(t, usage, c.want)
		})
	}
}

// A string that does not parse is not shown, and Check says why without
// quoting it.
func TestUnparsableIsNotShown(t *testing.T) {
	for _, dsn := range []string{
		"postgres://app:pa/ss-s3cret@db/payments", // a '/' not encoded
		"host=db password='unterminated s3cret",
		"password-s3cret",
	} {
		require.Error(t, Check(dsn), dsn)
		require.NotContains(t, Check(dsn).Error(), "s3cret", dsn)
		require.Equal(t, "(a connection string that does not parse)", Redacted(dsn), dsn)
		require.NotContains(t, usageWith(t, dsn), "s3cret", dsn)
	}
}

// usageWith is Usage with $DATABASE_URL set to dsn.
func usageWith(t *testing.T, dsn string) string {
	t.Setenv(EnvVar, dsn)
	return Usage()
}
